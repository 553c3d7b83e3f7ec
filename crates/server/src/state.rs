//! What every handler shares: the served models, settings, metrics, the shutdown flag.

use std::collections::BTreeMap;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use tokio::sync::Semaphore;

use crate::config::ServerSection;
use crate::error::ApiError;
use crate::helios::HeliosModel;
use crate::local::LocalModel;
use crate::metrics::Metrics;
use crate::modeswitch::ModeSwitchModel;
use crate::remote::RemoteModel;
use crate::serving::{Backend, Places, RequestContext, Started};
use crate::validate::ValidRequest;

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
    /// Places on the blocking pool for parsing large bodies and tokenizing admitted requests:
    /// one a core, so that a burst of long prompts queues here instead of starting a thread
    /// each or holding the runtime's workers.
    pub tokenizing: Arc<Semaphore>,
}

impl AppState {
    pub fn new(models: BTreeMap<String, Served>, config: ServerSection) -> Self {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        Self {
            models,
            config,
            metrics: Metrics::new(),
            shutting_down: AtomicBool::new(false),
            tokenizing: Arc::new(Semaphore::new(cores)),
        }
    }
}

impl Served {
    /// [`Backend::admit_and_start`] on whichever backend serves this model.
    pub(crate) async fn start(
        &self,
        req: ValidRequest,
        ctx: &RequestContext<'_>,
    ) -> Result<Started, ApiError> {
        match self {
            Served::Local(m) => m.admit_and_start(req, ctx).await,
            Served::Modes(m) => m.admit_and_start(req, ctx).await,
            Served::Remote(m) => m.admit_and_start(req, ctx).await,
            Served::Helios(m) => m.admit_and_start(req, ctx).await,
        }
    }

    /// Where this model's backend counts its requests in flight.
    pub(crate) fn places(&self) -> &Places {
        match self {
            Served::Local(m) => m.places(),
            Served::Modes(m) => m.places(),
            Served::Remote(m) => m.places(),
            Served::Helios(m) => m.places(),
        }
    }
}
