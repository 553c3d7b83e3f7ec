//! `switchyard router fit`: a rule policy fitted to a measured matrix. For each class of
//! requests, the fastest mode that keeps the constraints against f16 in the class's cells and
//! passes the quality [`Gate`] for the class, written as the same `[router]` rules the server
//! reads.
//!
//! Classes and the cells whose latency stands for them, in rule order (the first rule that
//! holds wins, as in the paper's policy):
//!
//! | rule | condition | cells |
//! |---|---|---|
//! | batch | class batch | batch |
//! | shared-prefix | class shared-prefix | shared-prefix |
//! | memory-pressure | memory pressure high | memory-pressure |
//! | math | workload gsm8k, math | SL, LL (long generations) |
//! | multiple-choice | workload mmlu, arc, hellaswag, ... | SS, LS (prompt-bound, short output) |
//! | prefill-heavy | class prefill-heavy | LS |
//! | decode-heavy | class decode-heavy | SL, LL |
//! | interactive | class interactive | SS |
//! | default | always | f16 |
//!
//! Math and multiple-choice requests are judged on their own tasks wherever they arrive: before
//! each of the first three rules goes a `math/<situation>` or `multiple-choice/<situation>`
//! rule (workload and situation both hold) where their gate picks another mode in that
//! situation's cells.
//!
//! A class whose cells the matrix lacks gets no rule (its requests fall through to the next
//! rule that holds, at worst the f16 default); the report says which and why. Where f16 could
//! not run a class's cell (the matrix's `baseline_failed`: memory pressure, typically), the
//! class gets the fastest mode that ran there and passes the gate and the memory limit, or no
//! rule if none does. Over several cells a mode is scored by the sum of its mean latencies, so
//! each cell weighs by its time.

use serde::Serialize;
use switchyard_request::Mode;

use crate::error::{Result, RouterError};
use crate::gate::{self, Gate};
use crate::oracle::{Constraints, ModeMatrix};
use crate::policy::{Condition, Policy, Rule};
use crate::rules::{Class, RuleConfig};

/// One fitted class: the mode chosen, its time against f16's, and why the faster modes were
/// refused.
#[derive(Debug, Clone, Serialize)]
pub struct FitChoice {
    pub class: String,
    /// The matrix cells that stood for the class.
    pub cells: Vec<String>,
    pub mode: Mode,
    /// Sum of the chosen mode's mean latencies over the cells, seconds.
    pub latency_s: f64,
    /// The same for f16; None where f16 cannot run in one of the cells.
    pub f16_latency_s: Option<f64>,
    /// Modes faster than the chosen one, with the reasons they were refused.
    pub refused: Vec<(Mode, Vec<String>)>,
}

#[derive(Debug, Clone, Serialize)]
pub struct FitReport {
    pub policy: Policy,
    pub choices: Vec<FitChoice>,
    /// Classes without a rule, and why.
    pub skipped: Vec<(String, String)>,
    /// The one mode admitted for every fitted class with the least summed latency over
    /// their cells (each class counted once), and that sum.
    pub best_fixed: Option<(Mode, f64)>,
    /// The fitted modes' summed latency over the same cells.
    pub fitted_latency_s: f64,
}

struct FitClass {
    id: &'static str,
    cells: &'static [&'static str],
    when: fn() -> Condition,
    /// The classifier (or memory pressure) puts a request here whatever its workload, so a math
    /// or multiple-choice request in this class is judged on its own tasks in these cells.
    situational: bool,
}

fn labels(ls: &[&str]) -> Vec<String> {
    ls.iter().map(|l| l.to_string()).collect()
}

const CLASSES: [FitClass; 8] = [
    FitClass {
        id: "batch",
        cells: &["batch"],
        when: || Condition::Class(Class::Batch),
        situational: true,
    },
    FitClass {
        id: "shared-prefix",
        cells: &["shared-prefix"],
        when: || Condition::Class(Class::SharedPrefix),
        situational: true,
    },
    FitClass {
        id: gate::CLASS_MEMORY_PRESSURE,
        cells: &["memory-pressure"],
        when: || Condition::MemoryPressureHigh,
        situational: true,
    },
    FitClass {
        id: gate::CLASS_MATH,
        cells: &["SL", "LL"],
        when: || Condition::Workload(labels(&gate::MATH_LABELS)),
        situational: false,
    },
    FitClass {
        id: gate::CLASS_MULTIPLE_CHOICE,
        cells: &["SS", "LS"],
        when: || Condition::Workload(labels(&gate::MULTIPLE_CHOICE_LABELS)),
        situational: false,
    },
    FitClass {
        id: "prefill-heavy",
        cells: &["LS"],
        when: || Condition::Class(Class::PrefillHeavy),
        situational: false,
    },
    FitClass {
        id: "decode-heavy",
        cells: &["SL", "LL"],
        when: || Condition::Class(Class::DecodeHeavy),
        situational: false,
    },
    FitClass {
        id: "interactive",
        cells: &["SS"],
        when: || Condition::Class(Class::Interactive),
        situational: false,
    },
];

/// The classes whose requests are judged on tasks of their own, wherever they arrive, and the
/// workload labels that mark them.
const QUALITY_CLASSES: [(&str, &[&str]); 2] = [
    (gate::CLASS_MATH, &gate::MATH_LABELS),
    (gate::CLASS_MULTIPLE_CHOICE, &gate::MULTIPLE_CHOICE_LABELS),
];

/// The fastest mode for one class over some cells, and the faster ones refused.
struct Pick {
    mode: Mode,
    latency_s: f64,
    /// f16's summed latency over the same cells, where it ran in all of them.
    f16_latency_s: Option<f64>,
    refused: Vec<(Mode, Vec<String>)>,
    /// Every mode admitted, with its summed latency.
    admitted: Vec<(Mode, f64)>,
}

/// The fastest mode measured in every one of `cells` that keeps the constraints against f16
/// there and passes `gate` for `class`. Over several cells a mode is scored by the sum of its
/// mean latencies. None where no mode passes and f16 could not run in one of the cells.
fn pick(
    matrix: &ModeMatrix,
    constraints: &Constraints,
    gate: &Gate,
    cells: &[&String],
    class: &str,
) -> Result<Option<Pick>> {
    let total = |mode: Mode| -> Option<f64> {
        cells
            .iter()
            .map(|c| matrix.cells[*c].get(&mode).map(|m| m.latency_s))
            .sum()
    };
    let mut candidates: Vec<(Mode, f64)> = Mode::ALL
        .iter()
        .filter_map(|&m| total(m).map(|t| (m, t)))
        .collect();
    candidates.sort_by(|a, b| a.1.total_cmp(&b.1));
    let reasons = |mode: Mode| -> Vec<String> {
        let mut why: Vec<String> = gate
            .failures(&matrix.quality, mode, class)
            .iter()
            .map(ToString::to_string)
            .collect();
        for c in cells {
            if !matrix.within(constraints, c, mode) {
                why.push(format!("{c}: outside the constraints against f16"));
            }
        }
        why
    };
    let mut refused = Vec::new();
    let mut chosen = None;
    let mut admitted = Vec::new();
    for &(mode, latency) in &candidates {
        let why = reasons(mode);
        if why.is_empty() {
            chosen.get_or_insert((mode, latency));
            admitted.push((mode, latency));
        } else if chosen.is_none() {
            refused.push((mode, why));
        }
    }
    // f16 is always admitted, so where it ran a mode is always chosen.
    let Some((mode, latency_s)) = chosen else {
        if cells
            .iter()
            .any(|c| matrix.baseline_failed.contains_key(*c))
        {
            return Ok(None);
        }
        return Err(RouterError::InvalidCell {
            cell: cells[0].clone(),
            reason: "no mode is admitted, not even f16".into(),
        });
    };
    Ok(Some(Pick {
        mode,
        latency_s,
        f16_latency_s: total(Mode::BASELINE),
        refused,
        admitted,
    }))
}

/// Why a class whose cells f16 could not run gets no rule: no mode that runs there passes.
fn unserved(matrix: &ModeMatrix, cells: &[&String]) -> String {
    let why: Vec<String> = cells
        .iter()
        .filter_map(|c| {
            matrix
                .baseline_failed
                .get(*c)
                .map(|reason| format!("{c}: {reason}"))
        })
        .collect();
    format!(
        "no mode that runs there passes the gate, and f16 cannot run there ({})",
        why.join("; ")
    )
}

/// Fits a policy to `matrix` (which must hold f16 in every cell it could run) under
/// `constraints` and `gate`, with `classifier`'s thresholds.
///
/// Before each situational rule (batch, shared-prefix, memory-pressure) come rules for the
/// math and multiple-choice requests in that situation (`math/shared-prefix`, ...), where the
/// fastest mode that passes their own class's gate in the situation's cells differs from the
/// situation's choice: a few-shot GSM8K prompt whose shots are cached is a shared-prefix
/// request, but still judged on GSM8K.
pub fn fit(
    matrix: &ModeMatrix,
    constraints: &Constraints,
    gate: &Gate,
    classifier: RuleConfig,
) -> Result<FitReport> {
    matrix.validate()?;
    constraints.validate()?;
    gate.validate()?;
    classifier.validate()?;
    let mut rules = Vec::new();
    let mut choices = Vec::new();
    let mut skipped = Vec::new();
    // Per mode: summed latency over the cells of the classes it is admitted for, and how many
    // those are (a mode admitted for every fitted class can serve them all alone).
    let mut per_mode: std::collections::BTreeMap<Mode, (f64, usize)> = Default::default();
    let mut add =
        |rules: &mut Vec<Rule>, id: String, when: Condition, cells: &[&String], p: Pick| {
            for &(mode, latency) in &p.admitted {
                let e = per_mode.entry(mode).or_insert((0.0, 0));
                e.0 += latency;
                e.1 += 1;
            }
            rules.push(Rule::new(&id, when, p.mode));
            choices.push(FitChoice {
                class: id,
                cells: cells.iter().map(|c| c.to_string()).collect(),
                mode: p.mode,
                latency_s: p.latency_s,
                f16_latency_s: p.f16_latency_s,
                refused: p.refused,
            });
        };
    for class in &CLASSES {
        let cells: Vec<&String> = class
            .cells
            .iter()
            .filter_map(|c| matrix.cells.keys().find(|k| k.eq_ignore_ascii_case(c)))
            .collect();
        if cells.is_empty() {
            skipped.push((
                class.id.to_string(),
                format!(
                    "the matrix has no {} cell (f16 must be measured there)",
                    class.cells.join(" or ")
                ),
            ));
            continue;
        }
        let own = pick(matrix, constraints, gate, &cells, class.id)?;
        if class.situational {
            for (q, marks) in QUALITY_CLASSES {
                let id = format!("{q}/{}", class.id);
                let Some(inner) = pick(matrix, constraints, gate, &cells, q)? else {
                    skipped.push((id, unserved(matrix, &cells)));
                    continue;
                };
                if own.as_ref().is_none_or(|o| o.mode != inner.mode) {
                    let when =
                        Condition::All(vec![Condition::Workload(labels(marks)), (class.when)()]);
                    add(&mut rules, id, when, &cells, inner);
                }
            }
        }
        match own {
            Some(own) => add(
                &mut rules,
                class.id.to_string(),
                (class.when)(),
                &cells,
                own,
            ),
            None => skipped.push((class.id.to_string(), unserved(matrix, &cells))),
        }
    }
    rules.push(Rule::new("default", Condition::Always, Mode::BASELINE));
    let policy = Policy::new(classifier, rules)?.with_gate(gate.clone())?;
    let best_fixed = per_mode
        .into_iter()
        .filter(|(_, (_, n))| *n == choices.len())
        .min_by(|a, b| a.1 .0.total_cmp(&b.1 .0))
        .map(|(m, (t, _))| (m, t));
    let fitted_latency_s = choices.iter().map(|c| c.latency_s).sum();
    Ok(FitReport {
        policy,
        choices,
        skipped,
        best_fixed,
        fitted_latency_s,
    })
}

impl FitReport {
    /// The policy file: a header saying how it was fitted, then the `[router]` table.
    pub fn policy_toml(&self, source: &str) -> Result<String> {
        let mut out = format!(
            "# ModeSwitch policy fitted by `switchyard router fit` to {source}.\n# Per class, the fastest mode that passes the quality gate ([router.gate]).\n"
        );
        for c in &self.choices {
            let f16 = c.f16_latency_s.map_or_else(
                || "f16 cannot run there".into(),
                |t| format!("f16 {t:.3} s"),
            );
            out.push_str(&format!(
                "# {}: {} ({:.3} s over {}, {f16})\n",
                c.class,
                c.mode,
                c.latency_s,
                c.cells.join("+"),
            ));
        }
        for (class, why) in &self.skipped {
            out.push_str(&format!("# {class}: no rule, {why}\n"));
        }
        out.push('\n');
        out.push_str(&self.policy.to_toml()?);
        Ok(out)
    }

    pub fn markdown(&self) -> String {
        let mut md = String::from(
            "| class | cells | mode | latency (s) | f16 (s) | speedup | faster modes refused |\n|---|---|---|---|---|---|---|\n",
        );
        for c in &self.choices {
            let refused = c
                .refused
                .iter()
                .map(|(m, why)| format!("{m}: {}", why.join("; ")))
                .collect::<Vec<_>>()
                .join("<br>");
            let (f16, speedup) = c.f16_latency_s.map_or_else(
                || ("cannot run".to_string(), "—".to_string()),
                |t| (format!("{t:.3}"), format!("{:.2}x", t / c.latency_s)),
            );
            md.push_str(&format!(
                "| {} | {} | {} | {:.3} | {f16} | {speedup} | {} |\n",
                c.class,
                c.cells.join("+"),
                c.mode,
                c.latency_s,
                if refused.is_empty() {
                    "—".into()
                } else {
                    refused
                },
            ));
        }
        for (class, why) in &self.skipped {
            md.push_str(&format!("| {class} | — | no rule | | | | {why} |\n"));
        }
        if let Some((mode, t)) = self.best_fixed {
            md.push_str(&format!(
                "\nOver these cells (each class once): the best single mode admitted for every class is **{mode}** ({t:.3} s); the fitted modes take {:.3} s, so routing by class could gain at most **{:.3}x** over it here.\n",
                self.fitted_latency_s,
                t / self.fitted_latency_s
            ));
        }
        md
    }
}
