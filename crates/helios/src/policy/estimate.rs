//! Operating points: what a model is expected to deliver at a depth, from what the online
//! evaluation measured (the PHT) and what the repository measured offline, and how points are
//! checked against the SLO and ranked for the objective.
//!
//! The PHT may hold a model at one depth only (the depth its evaluation ran at), while the
//! policy must judge every depth a partial load may stop at. A depth the PHT lacks is
//! estimated from the offline telemetry, corrected by how far the online measurement of the
//! same model drifted from its offline one at the nearest measured depth: throughput scaled
//! by the online/offline ratio (the machine is busier or idler than when profiled), bits per
//! byte shifted by the online/offline difference (the traffic is easier or harder than the
//! profile text).

use std::cmp::Ordering;

use crate::manifest::ModelEntry;
use crate::pht::{Pht, PhtRow};

use super::Objective;

/// Where an operating point's numbers come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Basis {
    /// The repository's offline telemetry as it is.
    Offline,
    /// The PHT row at this exact depth (throughput, bits per byte).
    Measured,
    /// Offline telemetry corrected by a PHT row of the same model at another depth.
    Scaled { from_depth: usize },
}

/// A model at a depth, with the numbers the policy judges it by.
#[derive(Debug, Clone, PartialEq)]
pub struct OperatingPoint {
    pub model: String,
    pub depth: usize,
    pub tokens_per_s: f64,
    pub ttft_ms: Option<f64>,
    pub bits_per_byte: f64,
    pub memory_bytes: u64,
    pub kv_bytes_per_token: u64,
    pub joules_per_token: Option<f64>,
    pub remote: bool,
    /// The whole model's size (the energy proxy of a remote model).
    pub size_bytes: u64,
    pub basis: Basis,
}

impl OperatingPoint {
    pub fn tpot_ms(&self) -> f64 {
        1000.0 / self.tokens_per_s
    }

    /// Weights plus `kv_tokens` positions of K/V; a remote model takes no local memory.
    pub fn memory_with_kv(&self, kv_tokens: usize) -> u64 {
        if self.remote {
            return 0;
        }
        self.memory_bytes
            .saturating_add(self.kv_bytes_per_token.saturating_mul(kv_tokens as u64))
    }

    /// Weight bytes read per output token: the energy proxy when joules were not measured.
    pub fn bytes_per_token(&self) -> u64 {
        if self.remote {
            self.size_bytes
        } else {
            self.memory_bytes
        }
    }
}

/// The repository's telemetry of `entry` at `depth`.
pub fn offline(entry: &ModelEntry, depth: usize) -> Option<OperatingPoint> {
    let t = entry.at(depth)?;
    Some(OperatingPoint {
        model: entry.name.clone(),
        depth,
        tokens_per_s: t.tokens_per_s,
        ttft_ms: t.ttft_ms,
        bits_per_byte: t.bits_per_byte,
        memory_bytes: t.memory_bytes,
        kv_bytes_per_token: t.kv_bytes_per_token.unwrap_or(0),
        joules_per_token: t.joules_per_token,
        remote: entry.is_remote(),
        size_bytes: entry.size_bytes,
        basis: Basis::Offline,
    })
}

/// The best estimate of `entry` at `depth` given the PHT (see the module doc). `None` when
/// the repository has no telemetry at that depth.
pub fn online(entry: &ModelEntry, pht: &Pht, depth: usize) -> Option<OperatingPoint> {
    let mut p = offline(entry, depth)?;
    if let Some(r) = pht.get(&entry.name, depth) {
        p.tokens_per_s = f64::from(r.tokens_per_s);
        p.bits_per_byte = f64::from(r.bits_per_byte);
        p.basis = Basis::Measured;
        return Some(p);
    }
    let nearest: Option<(&PhtRow, _)> = pht
        .of_model(&entry.name)
        .filter_map(|r| entry.at(usize::from(r.depth)).map(|t| (r, t)))
        .filter(|(r, _)| r.tokens_per_s > 0.0)
        .min_by_key(|(r, _)| usize::from(r.depth).abs_diff(depth));
    if let Some((r, t)) = nearest {
        let speed = f64::from(r.tokens_per_s) / t.tokens_per_s;
        p.tokens_per_s *= speed;
        p.ttft_ms = p.ttft_ms.map(|v| v / speed);
        p.bits_per_byte = (p.bits_per_byte + f64::from(r.bits_per_byte) - t.bits_per_byte).max(0.0);
        p.basis = Basis::Scaled {
            from_depth: usize::from(r.depth),
        };
    }
    Some(p)
}

/// The SLO and budget limits a point must respect.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Limits {
    /// Most bits per byte (the reference plus the allowed increase), if bounded.
    pub max_bits_per_byte: Option<f64>,
    pub ttft_ms: Option<f64>,
    pub tpot_ms: Option<f64>,
    pub budget_bytes: u64,
    pub min_kv_tokens: usize,
}

impl Limits {
    /// Why `p` does not fit, or `None` when it does.
    pub fn violation(&self, p: &OperatingPoint) -> Option<String> {
        if let Some(max) = self.max_bits_per_byte {
            if p.bits_per_byte > max {
                return Some(format!(
                    "{} bits per byte at depth {} exceeds {max:.4}",
                    fmt4(p.bits_per_byte),
                    p.depth
                ));
            }
        }
        if let Some(max) = self.tpot_ms {
            if p.tpot_ms() > max {
                return Some(format!(
                    "{:.1} ms per token at depth {} exceeds {max} ms",
                    p.tpot_ms(),
                    p.depth
                ));
            }
        }
        if let Some(max) = self.ttft_ms {
            match p.ttft_ms {
                None => {
                    return Some(format!(
                        "no time-to-first-token telemetry at depth {} to check {max} ms against",
                        p.depth
                    ))
                }
                Some(v) if v > max => {
                    return Some(format!(
                        "{v:.1} ms to the first token at depth {} exceeds {max} ms",
                        p.depth
                    ))
                }
                Some(_) => {}
            }
        }
        let need = p.memory_with_kv(self.min_kv_tokens);
        if need > self.budget_bytes {
            return Some(format!(
                "{need} bytes (weights at depth {} and {} K/V positions) exceed the budget",
                p.depth, self.min_kv_tokens
            ));
        }
        None
    }
}

fn fmt4(v: f64) -> String {
    format!("{v:.4}")
}

/// Orders points best first for `objective`. `use_joules`: every point being compared has a
/// measured energy (otherwise the energy objective falls back to bytes per token for all, so
/// that measured and estimated energies are never mixed).
pub fn compare(
    a: &OperatingPoint,
    b: &OperatingPoint,
    objective: Objective,
    use_joules: bool,
) -> Ordering {
    let by = |x: f64, y: f64| x.partial_cmp(&y).unwrap_or(Ordering::Equal);
    let primary = match objective {
        // Faster first; at equal speed the smaller footprint leaves room for a larger batch.
        Objective::Throughput => {
            by(b.tokens_per_s, a.tokens_per_s).then(a.memory_bytes.cmp(&b.memory_bytes))
        }
        Objective::Latency => by(a.tpot_ms(), b.tpot_ms()).then_with(|| {
            by(
                a.ttft_ms.unwrap_or(f64::INFINITY),
                b.ttft_ms.unwrap_or(f64::INFINITY),
            )
        }),
        Objective::Energy => {
            let energy = match (use_joules, a.joules_per_token, b.joules_per_token) {
                (true, Some(x), Some(y)) => by(x, y),
                _ => a.bytes_per_token().cmp(&b.bytes_per_token()),
            };
            energy.then(by(b.tokens_per_s, a.tokens_per_s))
        }
    };
    // Then better quality, then a stable order by name and depth.
    primary
        .then(by(a.bits_per_byte, b.bits_per_byte))
        .then_with(|| a.model.cmp(&b.model))
        .then(a.depth.cmp(&b.depth))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manifest::Manifest;
    use crate::policy::tests::row;

    fn repo() -> Manifest {
        Manifest::from_toml(crate::manifest::tests::EXAMPLE, "t").unwrap()
    }

    #[test]
    fn measured_rows_win_and_other_depths_are_scaled() {
        let repo = repo();
        let s = repo.get("smollm2-135m-instruct").unwrap();
        let mut pht = Pht::new(0.8);
        assert_eq!(online(s, &pht, 15).unwrap().basis, Basis::Offline);
        assert!(online(s, &pht, 12).is_none(), "no telemetry at 12");
        // Online at full depth: half the offline speed, 0.2 bits per byte worse.
        pht.upsert(row("smollm2-135m-instruct", 30, 19.25, 1.27, &[]));
        let full = online(s, &pht, 30).unwrap();
        assert_eq!(full.basis, Basis::Measured);
        assert!((full.tokens_per_s - 19.25).abs() < 1e-6);
        let half = online(s, &pht, 15).unwrap();
        assert_eq!(half.basis, Basis::Scaled { from_depth: 30 });
        assert!(
            (half.tokens_per_s - 30.5).abs() < 1e-4,
            "{}",
            half.tokens_per_s
        );
        assert!(
            (half.bits_per_byte - 3.11).abs() < 1e-6,
            "{}",
            half.bits_per_byte
        );
        assert!((half.ttft_ms.unwrap() - 80.0).abs() < 1e-4);
        assert_eq!(half.memory_bytes, 58_000_000);
    }

    #[test]
    fn limits_name_the_first_violation() {
        let repo = repo();
        let p = offline(repo.get("smollm2-135m-instruct").unwrap(), 15).unwrap();
        let mut l = Limits {
            max_bits_per_byte: None,
            ttft_ms: None,
            tpot_ms: None,
            budget_bytes: 1 << 30,
            min_kv_tokens: 2048,
        };
        assert_eq!(l.violation(&p), None);
        l.max_bits_per_byte = Some(2.0);
        assert!(l.violation(&p).unwrap().contains("bits per byte"));
        l.max_bits_per_byte = None;
        l.tpot_ms = Some(10.0);
        assert!(l.violation(&p).unwrap().contains("ms per token"));
        l.tpot_ms = None;
        // 58 MB of weights + 2048 × 11,520 bytes of K/V = 81,592,960 bytes.
        l.budget_bytes = 81_592_959;
        assert!(l.violation(&p).unwrap().contains("81592960 bytes"));
        l.budget_bytes = 81_592_960;
        assert_eq!(l.violation(&p), None);
        let remote = offline(repo.get("big-remote").unwrap(), 32).unwrap();
        l.budget_bytes = 0;
        assert_eq!(
            l.violation(&remote),
            None,
            "remote models take no local memory"
        );
        l.ttft_ms = Some(100.0);
        assert!(l
            .violation(&remote)
            .unwrap()
            .contains("no time-to-first-token"));
    }

    #[test]
    fn objectives_order_points() {
        let repo = repo();
        let s = repo.get("smollm2-135m-instruct").unwrap();
        let (d15, d30) = (offline(s, 15).unwrap(), offline(s, 30).unwrap());
        let r = offline(repo.get("big-remote").unwrap(), 32).unwrap();
        assert_eq!(
            compare(&d15, &r, Objective::Throughput, false),
            Ordering::Less
        );
        assert_eq!(
            compare(&r, &d30, Objective::Throughput, false),
            Ordering::Less
        );
        assert_eq!(
            compare(&d15, &d30, Objective::Latency, false),
            Ordering::Less
        );
        // Energy by bytes per token: 58 MB < 98 MB < 16 GB (remote: the whole model).
        assert_eq!(
            compare(&d15, &d30, Objective::Energy, false),
            Ordering::Less
        );
        assert_eq!(compare(&d30, &r, Objective::Energy, false), Ordering::Less);
        // Measured joules decide when every point has them.
        let (mut a, mut b) = (d15.clone(), d30.clone());
        a.joules_per_token = Some(2.0);
        b.joules_per_token = Some(1.0);
        assert_eq!(compare(&a, &b, Objective::Energy, true), Ordering::Greater);
        assert_eq!(compare(&a, &b, Objective::Energy, false), Ordering::Less);
    }
}
