//! The ModeSwitch router (in progress).
