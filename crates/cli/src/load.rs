//! Opening a model by zoo name or path: weights, tokenizer, layered model.

use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use switchyard_models::{LayeredModel, LoadOptions};
use switchyard_tokenizer::Tokenizer;

pub struct Loaded {
    pub name: String,
    pub model: LayeredModel,
    pub tokenizer: Tokenizer,
}

pub fn load_model(name_or_path: &str, opts: &LoadOptions) -> anyhow::Result<Loaded> {
    let path = switchyard_zoo::resolve_model(name_or_path)?;
    let t0 = Instant::now();
    let source =
        switchyard_weights::open(&path).with_context(|| format!("opening {}", path.display()))?;
    let tokenizer = Tokenizer::from_source(&*source)
        .with_context(|| format!("reading the tokenizer of {}", path.display()))?;
    let model = LayeredModel::load(Arc::clone(&source), opts)
        .with_context(|| format!("loading {}", path.display()))?;
    let bytes = model.resident_bytes();
    eprintln!(
        "loaded {} ({}, {} layers, {:.1} MB resident) in {:.2} s",
        name_or_path,
        model.spec().architecture.as_str(),
        model.n_layers(),
        bytes.total() as f64 / 1e6,
        t0.elapsed().as_secs_f64()
    );
    Ok(Loaded {
        name: name_or_path.to_string(),
        model,
        tokenizer,
    })
}

/// A text file argument: an existing path, or the name of a zoo dataset.
pub fn resolve_text(path_or_dataset: &str) -> anyhow::Result<std::path::PathBuf> {
    let p = std::path::Path::new(path_or_dataset);
    if p.exists() {
        return Ok(p.to_path_buf());
    }
    match switchyard_zoo::find(path_or_dataset) {
        Some(a) if a.kind == switchyard_zoo::AssetKind::Dataset => {
            Ok(switchyard_zoo::ensure(path_or_dataset)?)
        }
        _ => anyhow::bail!(
            "{path_or_dataset} is neither a file nor a dataset name (datasets: {})",
            switchyard_zoo::catalog()
                .iter()
                .filter(|a| a.kind == switchyard_zoo::AssetKind::Dataset)
                .map(|a| a.name)
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}
