//! What every handler shares: the served models, settings, metrics, the shutdown flag.

use std::collections::BTreeMap;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use crate::config::ServerSection;
use crate::helios::HeliosModel;
use crate::local::LocalModel;
use crate::metrics::Metrics;
use crate::modeswitch::ModeSwitchModel;
use crate::remote::RemoteModel;

#[derive(Clone)]
pub enum Served {
    Local(Arc<LocalModel>),
    Remote(Arc<RemoteModel>),
    /// The HELIOS orchestrator over several local engines.
    Helios(Arc<HeliosModel>),
    /// One model in the mode the ModeSwitch router picks per request.
    Modes(Arc<ModeSwitchModel>),
}

pub struct AppState {
    pub models: BTreeMap<String, Served>,
    pub config: ServerSection,
    pub metrics: Metrics,
    /// Set by SIGINT/SIGTERM: new requests get 503 while running ones finish.
    pub shutting_down: AtomicBool,
}
