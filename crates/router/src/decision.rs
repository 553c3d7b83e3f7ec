//! What every router answers (a [`Decision`]), the set of modes that can be served right now
//! ([`ModeSet`]), and the [`Router`] seam a server or benchmark routes through.

use serde::{Deserialize, Serialize};
use switchyard_request::Mode;

use crate::features::RequestFeatures;
use crate::rules::{Class, RuleConfig};

/// The mode a request is served in, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Decision {
    /// The mode to serve the request in.
    pub mode: Mode,
    /// What chose it: `"<n>:<id>"` for the n-th policy rule, `"oracle"`, `"tree"`,
    /// `"forest"`, `"logistic"` or `"fixed"`.
    pub rule: String,
    /// The classifier's view of the request (reported by every router, whether it used it or
    /// not, so decisions of different routers can be compared).
    pub class: Class,
    /// True when the chosen mode could not be served and the baseline stands in for it.
    pub fallback: bool,
}

impl Decision {
    /// `mode` if it is available, else [`Mode::BASELINE`] marked as a fallback.
    pub fn checked(mode: Mode, rule: String, class: Class, available: ModeSet) -> Decision {
        if available.contains(mode) {
            Decision {
                mode,
                rule,
                class,
                fallback: false,
            }
        } else {
            Decision {
                mode: Mode::BASELINE,
                rule,
                class,
                fallback: true,
            }
        }
    }
}

/// A set of modes, e.g. those loaded and fitting in memory now. Copy-cheap (one bit per mode).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct ModeSet(u16);

impl ModeSet {
    /// No mode.
    pub const fn empty() -> ModeSet {
        ModeSet(0)
    }

    /// Every mode of [`Mode::ALL`].
    pub fn all() -> ModeSet {
        Mode::ALL.into_iter().collect()
    }

    fn bit(mode: Mode) -> u16 {
        // Mode::ALL has 15 entries, so every position fits a u16 bit.
        let position = Mode::ALL.iter().position(|&m| m == mode).unwrap_or(0);
        1 << position
    }

    pub fn contains(self, mode: Mode) -> bool {
        self.0 & Self::bit(mode) != 0
    }

    pub fn insert(&mut self, mode: Mode) {
        self.0 |= Self::bit(mode);
    }

    pub fn remove(&mut self, mode: Mode) {
        self.0 &= !Self::bit(mode);
    }

    /// This set without `mode`.
    pub fn without(mut self, mode: Mode) -> ModeSet {
        self.remove(mode);
        self
    }

    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// The modes in the set, in [`Mode::ALL`] order.
    pub fn iter(self) -> impl Iterator<Item = Mode> {
        Mode::ALL.into_iter().filter(move |&m| self.contains(m))
    }
}

impl FromIterator<Mode> for ModeSet {
    fn from_iter<I: IntoIterator<Item = Mode>>(iter: I) -> Self {
        let mut set = ModeSet::empty();
        for m in iter {
            set.insert(m);
        }
        set
    }
}

impl std::fmt::Debug for ModeSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_set().entries(self.iter().map(Mode::name)).finish()
    }
}

/// A per-request mode chooser. Routing is pure: the same features and available modes give
/// the same decision, and it never fails (an unservable choice becomes the baseline with
/// `fallback: true`).
pub trait Router: Send + Sync {
    /// A short name for reports ("rules", "oracle", "tree", "fixed:int8", ...).
    fn name(&self) -> String;

    /// The decision for a request when only `available` modes can be served.
    fn route_among(&self, f: &RequestFeatures, available: ModeSet) -> Decision;

    /// The decision for a request when every mode can be served.
    fn route(&self, f: &RequestFeatures) -> Decision {
        self.route_among(f, ModeSet::all())
    }
}

/// No controller: every request gets the same mode (the fixed-configuration baseline).
#[derive(Debug, Clone)]
pub struct FixedRouter {
    pub mode: Mode,
    /// Only used to report each request's class.
    pub classifier: RuleConfig,
}

impl FixedRouter {
    pub fn new(mode: Mode) -> FixedRouter {
        FixedRouter {
            mode,
            classifier: RuleConfig::default(),
        }
    }
}

impl Router for FixedRouter {
    fn name(&self) -> String {
        format!("fixed:{}", self.mode)
    }

    fn route_among(&self, f: &RequestFeatures, available: ModeSet) -> Decision {
        let class = self.classifier.classify(f);
        Decision::checked(self.mode, "fixed".to_string(), class, available)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mode_set_holds_each_mode_once() {
        let all = ModeSet::all();
        assert_eq!(all.iter().count(), 15);
        assert!(Mode::ALL.iter().all(|&m| all.contains(m)));
        let set = all.without(Mode::Speculative);
        assert!(!set.contains(Mode::Speculative) && set.contains(Mode::Int8));
        assert_eq!(set.iter().count(), 14);
        let small: ModeSet = [Mode::Q4, Mode::F16].into_iter().collect();
        assert_eq!(small.iter().collect::<Vec<_>>(), vec![Mode::F16, Mode::Q4]);
        assert_eq!(format!("{small:?}"), r#"{"f16", "q4"}"#);
        assert!(ModeSet::empty().is_empty());
    }

    #[test]
    fn fixed_router_serves_its_mode_or_falls_back() {
        let r = FixedRouter::new(Mode::Int8);
        let f = RequestFeatures {
            prompt_tokens: 128,
            max_output_tokens: 32,
            ..Default::default()
        };
        assert_eq!(r.name(), "fixed:int8");
        assert_eq!(
            r.route(&f),
            Decision {
                mode: Mode::Int8,
                rule: "fixed".into(),
                class: Class::Interactive,
                fallback: false,
            }
        );
        let d = r.route_among(&f, ModeSet::all().without(Mode::Int8));
        assert_eq!((d.mode, d.fallback), (Mode::F16, true));
    }
}
