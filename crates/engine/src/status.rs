//! Whether an engine thread serves: its status, shared by its handles, the thread and its
//! requests' output sinks.

use std::sync::atomic::{AtomicU8, Ordering};

use crate::EngineError;

/// Whether an engine thread serves, as [`crate::EngineHandle::status`] reports it; ordered from
/// best to worst.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
#[repr(u8)]
pub enum EngineStatus {
    Running = 0,
    /// A backend whose server cannot be reached (see [`crate::Reachability`]): its requests fail
    /// until its health check passes again, and then it serves again.
    Unreachable = 1,
    /// Shut down, or every handle was dropped.
    Stopped = 2,
    /// The thread panicked: its requests ended with [`EngineError::EngineFailed`], and it
    /// takes no more. Nothing restarts it (its state may be corrupt).
    Failed = 3,
}

impl EngineStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            EngineStatus::Running => "running",
            EngineStatus::Unreachable => "unreachable",
            EngineStatus::Stopped => "stopped",
            EngineStatus::Failed => "failed",
        }
    }
}

/// An engine thread's status, shared by its handles, the thread and its requests' sinks.
#[derive(Debug)]
pub(crate) struct Liveness {
    pub(crate) model: String,
    pub(crate) status: AtomicU8,
}

impl Liveness {
    pub(crate) fn new(model: &str) -> Self {
        Self {
            model: model.to_string(),
            status: AtomicU8::new(EngineStatus::Running as u8),
        }
    }

    pub(crate) fn status(&self) -> EngineStatus {
        match self.status.load(Ordering::SeqCst) {
            0 => EngineStatus::Running,
            1 => EngineStatus::Unreachable,
            2 => EngineStatus::Stopped,
            _ => EngineStatus::Failed,
        }
    }

    pub(crate) fn fail(&self) {
        self.status
            .store(EngineStatus::Failed as u8, Ordering::SeqCst);
    }

    /// Marks a thread that returned stopped, unless it had failed.
    pub(crate) fn stop(&self) {
        let _ = self
            .status
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |s| {
                (s < EngineStatus::Stopped as u8).then_some(EngineStatus::Stopped as u8)
            });
    }

    pub(crate) fn failure(&self) -> EngineError {
        EngineError::EngineFailed {
            model: self.model.clone(),
        }
    }
}
