//! `switchyard serve`: the OpenAI-compatible HTTP server.

use clap::Args;
use switchyard_server::config::Config;

#[derive(Args)]
pub struct ServeArgs {
    /// TOML configuration (models, budget, engine settings, keys, backends). Without one, the
    /// default model from `switchyard models pull` is served on 127.0.0.1:8000.
    #[arg(long)]
    config: Option<std::path::PathBuf>,
    /// Address to bind (overrides the config). Default 127.0.0.1: not reachable from other
    /// machines unless asked.
    #[arg(long)]
    host: Option<String>,
    /// Port (overrides the config; 0 picks a free one).
    #[arg(long)]
    port: Option<u16>,
    /// Require `Authorization: Bearer KEY` on /v1 and /admin (repeatable; adds to the config's).
    #[arg(long = "api-key", env = "SWITCHYARD_API_KEY")]
    api_keys: Vec<String>,
    /// Serve the /admin routes.
    #[arg(long)]
    admin: bool,
    /// Memory budget of the default model's engine, e.g. 2GiB (only without --config).
    #[arg(long, conflicts_with = "config")]
    memory_budget: Option<String>,
    /// Model to serve without a config (zoo name or path).
    #[arg(long, conflicts_with = "config")]
    model: Option<String>,
}

pub fn run(a: ServeArgs) -> anyhow::Result<()> {
    let mut cfg = match &a.config {
        Some(p) => Config::load(p)?,
        None => {
            let mut c = Config::default_model();
            if let Some(m) = &a.model {
                c.models[0].name = m.clone();
            }
            c.models[0].memory_budget = a.memory_budget.clone();
            c
        }
    };
    if let Some(h) = a.host {
        cfg.server.host = h;
    }
    if let Some(p) = a.port {
        cfg.server.port = p;
    }
    cfg.server.api_keys.extend(a.api_keys);
    cfg.server.admin |= a.admin;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(switchyard_server::serve(cfg, |addr| {
        // Scripts and tests wait for this line.
        eprintln!("switchyard listening on http://{addr}");
    }))?;
    eprintln!("switchyard stopped");
    Ok(())
}
