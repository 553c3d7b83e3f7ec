//! Learned routers that imitate the oracle from request features alone: a decision tree, a
//! random forest and a logistic regression (smartcore), trained on (features, oracle mode)
//! pairs. The paper found they do not beat the rules; they are here to measure that claim.

use std::path::Path;

use serde::{Deserialize, Serialize};
use smartcore::ensemble::random_forest_classifier::{
    RandomForestClassifier, RandomForestClassifierParameters,
};
use smartcore::linalg::basic::matrix::DenseMatrix;
use smartcore::linear::logistic_regression::{LogisticRegression, LogisticRegressionParameters};
use smartcore::tree::decision_tree_classifier::{
    DecisionTreeClassifier, DecisionTreeClassifierParameters,
};
use switchyard_request::Mode;

use crate::decision::{Decision, ModeSet, Router};
use crate::error::{Result, RouterError};
use crate::features::{RequestFeatures, FEATURE_COUNT, FEATURE_NAMES};
use crate::rules::RuleConfig;

/// Trees in the random forest (smartcore's default is 100; 50 already votes stably on the
/// 13 features here and halves training time).
pub const FOREST_TREES: u16 = 50;
/// L2 penalty of the logistic regression on standardised features; a little keeps the weights
/// finite when the oracle's classes are linearly separable.
pub const LOGISTIC_ALPHA: f64 = 1e-3;
/// Standard deviation below which a feature is treated as constant (left unscaled).
const MIN_STD: f64 = 1e-12;

/// One training example: a request and the mode the teacher (the oracle) chose for it.
pub type Example = (RequestFeatures, Mode);

/// Which learner.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LearnedKind {
    Tree,
    Forest,
    Logistic,
}

impl LearnedKind {
    pub const ALL: [LearnedKind; 3] = [
        LearnedKind::Tree,
        LearnedKind::Forest,
        LearnedKind::Logistic,
    ];

    pub fn name(self) -> &'static str {
        match self {
            LearnedKind::Tree => "tree",
            LearnedKind::Forest => "forest",
            LearnedKind::Logistic => "logistic",
        }
    }
}

/// Hyperparameters of the learners.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LearnedParams {
    /// Depth cap of the decision tree (none: grow until leaves are pure).
    pub tree_max_depth: Option<u16>,
    pub forest_trees: u16,
    /// Depth cap of each forest tree.
    pub forest_max_depth: Option<u16>,
    pub logistic_alpha: f64,
}

impl Default for LearnedParams {
    fn default() -> Self {
        Self {
            tree_max_depth: None,
            forest_trees: FOREST_TREES,
            forest_max_depth: None,
            logistic_alpha: LOGISTIC_ALPHA,
        }
    }
}

type Matrix = DenseMatrix<f64>;
/// Labels are positions in [`Mode::ALL`].
type Labels = Vec<u32>;

/// Per-column mean and standard deviation of the training features.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Standardizer {
    pub means: [f64; FEATURE_COUNT],
    pub stds: [f64; FEATURE_COUNT],
}

impl Standardizer {
    fn fit(rows: &[[f64; FEATURE_COUNT]]) -> Standardizer {
        let n = rows.len().max(1) as f64;
        let mut means = [0.0; FEATURE_COUNT];
        let mut stds = [0.0; FEATURE_COUNT];
        for row in rows {
            for (m, x) in means.iter_mut().zip(row) {
                *m += x / n;
            }
        }
        for row in rows {
            for ((s, x), m) in stds.iter_mut().zip(row).zip(&means) {
                *s += (x - m).powi(2) / n;
            }
        }
        for s in &mut stds {
            *s = if s.sqrt() < MIN_STD { 1.0 } else { s.sqrt() };
        }
        Standardizer { means, stds }
    }

    fn apply(&self, row: &[f64; FEATURE_COUNT]) -> [f64; FEATURE_COUNT] {
        let mut out = [0.0; FEATURE_COUNT];
        for (i, o) in out.iter_mut().enumerate() {
            *o = (row[i] - self.means[i]) / self.stds[i];
        }
        out
    }
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
enum Model {
    /// Every training example had the same mode (the learners need two classes).
    Constant(Mode),
    Tree(DecisionTreeClassifier<f64, u32, Matrix, Labels>),
    Forest(RandomForestClassifier<f64, u32, Matrix, Labels>),
    Logistic(
        LogisticRegression<f64, u32, Matrix, Labels>,
        Box<Standardizer>,
    ),
}

/// Version of the file [`LearnedRouter::save`] writes.
pub const ROUTER_FILE_VERSION: u32 = 1;

/// A saved router.
#[derive(Serialize, Deserialize)]
struct RouterFile<M> {
    format_version: u32,
    kind: LearnedKind,
    features: Vec<String>,
    model: M,
}

/// A trained imitation of the oracle.
#[derive(Debug)]
pub struct LearnedRouter {
    kind: LearnedKind,
    model: Model,
    /// Only used to report each request's class.
    classifier: RuleConfig,
}

fn mode_index(mode: Mode) -> u32 {
    Mode::ALL.iter().position(|&m| m == mode).unwrap_or(0) as u32
}

fn matrix(rows: &[[f64; FEATURE_COUNT]]) -> std::result::Result<Matrix, String> {
    let values = rows.iter().flatten().copied().collect();
    DenseMatrix::new(rows.len(), FEATURE_COUNT, values, false).map_err(|e| e.to_string())
}

impl LearnedRouter {
    /// Trains with the default hyperparameters; the same data and seed give the same router.
    pub fn train(kind: LearnedKind, data: &[Example], seed: u64) -> Result<LearnedRouter> {
        LearnedRouter::train_with(kind, data, seed, &LearnedParams::default())
    }

    pub fn train_with(
        kind: LearnedKind,
        data: &[Example],
        seed: u64,
        params: &LearnedParams,
    ) -> Result<LearnedRouter> {
        let Some((_, first)) = data.first() else {
            return Err(RouterError::EmptyTrainingSet);
        };
        let failed = |e: String| RouterError::Training {
            kind: kind.name(),
            message: e,
        };
        let rows: Vec<_> = data.iter().map(|(f, _)| f.vector()).collect();
        let labels: Labels = data.iter().map(|(_, m)| mode_index(*m)).collect();
        let model = if data.iter().all(|(_, m)| m == first) {
            Model::Constant(*first)
        } else {
            match kind {
                LearnedKind::Tree => {
                    let p = DecisionTreeClassifierParameters {
                        max_depth: params.tree_max_depth,
                        seed: Some(seed),
                        ..Default::default()
                    };
                    let x = matrix(&rows).map_err(failed)?;
                    Model::Tree(
                        DecisionTreeClassifier::fit(&x, &labels, p)
                            .map_err(|e| failed(e.to_string()))?,
                    )
                }
                LearnedKind::Forest => {
                    let p = RandomForestClassifierParameters {
                        max_depth: params.forest_max_depth,
                        n_trees: params.forest_trees,
                        seed,
                        ..Default::default()
                    };
                    let x = matrix(&rows).map_err(failed)?;
                    Model::Forest(
                        RandomForestClassifier::fit(&x, &labels, p)
                            .map_err(|e| failed(e.to_string()))?,
                    )
                }
                LearnedKind::Logistic => {
                    let scaler = Standardizer::fit(&rows);
                    let scaled: Vec<_> = rows.iter().map(|r| scaler.apply(r)).collect();
                    let x = matrix(&scaled).map_err(failed)?;
                    let p =
                        LogisticRegressionParameters::default().with_alpha(params.logistic_alpha);
                    Model::Logistic(
                        LogisticRegression::fit(&x, &labels, p)
                            .map_err(|e| failed(e.to_string()))?,
                        Box::new(scaler),
                    )
                }
            }
        };
        Ok(LearnedRouter {
            kind,
            model,
            classifier: RuleConfig::default(),
        })
    }

    pub fn kind(&self) -> LearnedKind {
        self.kind
    }

    /// The standardisation the logistic regression was trained with.
    pub fn standardizer(&self) -> Option<&Standardizer> {
        match &self.model {
            Model::Logistic(_, s) => Some(s),
            _ => None,
        }
    }

    /// The mode the model predicts, before availability; `None` if the model refused the row.
    pub fn predict(&self, f: &RequestFeatures) -> Option<Mode> {
        let row = f.vector();
        let predicted = match &self.model {
            Model::Constant(mode) => return Some(*mode),
            Model::Tree(t) => t.predict(&matrix(&[row]).ok()?),
            Model::Forest(t) => t.predict(&matrix(&[row]).ok()?),
            Model::Logistic(t, s) => t.predict(&matrix(&[s.apply(&row)]).ok()?),
        };
        let index = *predicted.ok()?.first()?;
        Mode::ALL.get(index as usize).copied()
    }

    /// Writes the router as JSON: the learner, the feature names it was trained on, and the
    /// fitted model (smartcore's own serialisation).
    pub fn save(&self, path: &Path) -> Result<()> {
        let file = RouterFile {
            format_version: ROUTER_FILE_VERSION,
            kind: self.kind,
            features: FEATURE_NAMES.iter().map(|s| s.to_string()).collect(),
            model: &self.model,
        };
        let bad = |reason: String| RouterError::RouterFile {
            path: path.display().to_string(),
            reason,
        };
        let text = serde_json::to_string(&file).map_err(|e| bad(e.to_string()))?;
        std::fs::write(path, text).map_err(|e| bad(e.to_string()))
    }

    /// Reads a router [`LearnedRouter::save`] wrote; refuses files of another format version
    /// or trained on other features.
    pub fn load(path: &Path) -> Result<LearnedRouter> {
        let bad = |reason: String| RouterError::RouterFile {
            path: path.display().to_string(),
            reason,
        };
        let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
        let file: RouterFile<Model> =
            serde_json::from_str(&text).map_err(|e| bad(format!("not a learned router: {e}")))?;
        if file.format_version != ROUTER_FILE_VERSION {
            return Err(bad(format!(
                "format version {} (this build reads {ROUTER_FILE_VERSION})",
                file.format_version
            )));
        }
        if file.features != FEATURE_NAMES {
            return Err(bad(format!(
                "trained on features {:?}; this build computes {:?}",
                file.features, FEATURE_NAMES
            )));
        }
        Ok(LearnedRouter {
            kind: file.kind,
            model: file.model,
            classifier: RuleConfig::default(),
        })
    }

    /// Share of `data` whose mode the router reproduces (0 for no data).
    pub fn accuracy(&self, data: &[Example]) -> f64 {
        if data.is_empty() {
            return 0.0;
        }
        let hits = data
            .iter()
            .filter(|(f, mode)| self.predict(f) == Some(*mode))
            .count();
        hits as f64 / data.len() as f64
    }
}

impl Router for LearnedRouter {
    fn name(&self) -> String {
        self.kind.name().to_string()
    }

    fn route_among(&self, f: &RequestFeatures, available: ModeSet) -> Decision {
        let class = self.classifier.classify(f);
        let rule = self.kind.name().to_string();
        match self.predict(f) {
            Some(mode) => Decision::checked(mode, rule, class, available),
            None => Decision {
                mode: Mode::BASELINE,
                rule,
                class,
                fallback: true,
            },
        }
    }
}
