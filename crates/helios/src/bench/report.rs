//! The benchmark's report as people read it: Markdown tables and PNG charts.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use switchyard_charts::{fonts_available, line_chart, Chart, Series};

use super::{AblationRow, HeliosBenchReport, RequestRecord};
use crate::{HeliosError, Result};

fn mib(b: u64) -> f64 {
    b as f64 / (1u64 << 20) as f64
}

impl HeliosBenchReport {
    /// The systems side by side, then HELIOS's decisions and the ablations.
    pub fn markdown(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "### HELIOS vs EE-LLM vs vanilla: candidates {}, vanilla {}, {} prompts of {}, budget {:.0} MiB, threshold {}, {} threads\n",
            self.candidates.join(", "),
            self.vanilla_model,
            self.vanilla.requests,
            self.dataset,
            mib(self.memory_budget_bytes),
            self.threshold,
            self.threads
        );
        let _ = writeln!(s, "| system | requests | output tokens | tokens/s | TTFT mean / P50 / P99 (s) | TPOT mean / P50 / P99 (ms) | earliest exit | full depth | largest batch | peak resident (MiB) | bits/byte | Δ vs full |");
        let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|---|---|---|");
        for r in [&self.vanilla, &self.ee_llm, &self.helios]
            .into_iter()
            .chain(self.helios_serial.as_ref())
        {
            let _ = writeln!(
                s,
                "| {} | {} | {} | {:.2} | {:.2} / {:.2} / {:.2} | {:.1} / {:.1} / {:.1} | {:.1}% | {:.1}% | {} | {:.1} | {:.4} | {:+.4} |",
                r.system,
                r.requests,
                r.output_tokens,
                r.output_tokens_per_s,
                r.ttft_s.mean,
                r.ttft_s.p50,
                r.ttft_s.p99,
                r.tpot_s.mean * 1e3,
                r.tpot_s.p50 * 1e3,
                r.tpot_s.p99 * 1e3,
                100.0 * r.earliest_exit_share,
                100.0 * r.full_depth_share,
                r.largest_batch,
                mib(r.peak_resident_bytes),
                r.bits_per_byte,
                r.bits_per_byte_vs_full
            );
        }
        let _ = writeln!(
            s,
            "\nHELIOS / EE-LLM: {:.2}x output tokens/s, {:.1}x largest batch, TPOT P50 {:+.1}%; HELIOS / vanilla: {:.2}x output tokens/s.",
            self.helios_vs_ee_llm_throughput,
            self.helios_vs_ee_llm_batch,
            -100.0 * self.helios_tpot_p50_reduction_vs_ee_llm,
            self.helios_vs_vanilla_throughput
        );
        if let Some(x) = self.helios_serial_vs_vanilla_throughput {
            let _ = writeln!(s, "HELIOS serial / vanilla: {x:.2}x output tokens/s.");
        }
        if self.pairs.len() > 1 {
            let _ = writeln!(
                s,
                "\nVanilla and HELIOS {} alternating, {} times each (the first pair is the table's):\n",
                self.helios.system,
                self.pairs.len()
            );
            let _ = writeln!(
                s,
                "| pair | first | vanilla tok/s | HELIOS tok/s | HELIOS / vanilla | TTFT P99 vanilla / HELIOS (s) |"
            );
            let _ = writeln!(s, "|---|---|---|---|---|---|");
            for (i, p) in self.pairs.iter().enumerate() {
                let _ = writeln!(
                    s,
                    "| {} | {} | {:.2} | {:.2} | {:.3}x | {:.2} / {:.2} |",
                    i + 1,
                    p.first,
                    p.vanilla_output_tokens_per_s,
                    p.helios_output_tokens_per_s,
                    p.helios_vs_vanilla_throughput,
                    p.vanilla_ttft_p99_s,
                    p.helios_ttft_p99_s
                );
            }
            let (lo, hi) = self
                .pairs
                .iter()
                .map(|p| p.helios_vs_vanilla_throughput)
                .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), x| {
                    (a.min(x), b.max(x))
                });
            let _ = writeln!(
                s,
                "\nHELIOS / vanilla, median of the pairs: {:.3}x (range {lo:.3}–{hi:.3}x).",
                self.helios_vs_vanilla_throughput_median
            );
        }
        // Shadow evaluation serves no evaluation request.
        if let Some(d) = self
            .helios
            .decisions
            .as_ref()
            .filter(|d| d.evaluation_requests == 0)
        {
            let _ = writeln!(
                s,
                "\nHELIOS shadow scoring: {} rounds, {:.1} s computing ({:.1}% of its time), scorers' peak {:.1} MiB (counted in peak resident); {} switches, {} depth changes.",
                d.shadow_rounds,
                d.shadow_busy_seconds,
                100.0 * d.shadow_share_used,
                mib(d.shadow_peak_bytes),
                d.switches,
                d.extends
            );
        }
        if let Some(d) = self
            .helios_serial
            .as_ref()
            .or(Some(&self.helios))
            .and_then(|r| r.decisions.as_ref())
            .filter(|d| d.evaluation_requests > 0)
        {
            let _ = writeln!(
                s,
                "\nHELIOS serial decisions: {} profiles ({} re-profiles, {:.3} s of loads and decisions), {} extends ({:.3} s), {} switches ({:.3} s, {} sequences drained), CBC fired {} times; {} evaluation requests.",
                d.profiles,
                d.reprofiles,
                d.profile_seconds,
                d.extends,
                d.extend_seconds,
                d.switches,
                d.switch_seconds,
                d.switch_drained,
                d.cbc_fired,
                d.evaluation_requests
            );
        }
        let by_model: Vec<String> = self
            .helios
            .tokens_by_model
            .iter()
            .map(|(m, t)| format!("{m}: {t}"))
            .collect();
        let _ = writeln!(s, "HELIOS output tokens by model: {}.", by_model.join(", "));
        if let Some(eq) = self.ee_llm.tokens_equal_to_vanilla {
            let _ = writeln!(
                s,
                "EE-LLM tokens equal to vanilla's at the same position: {eq} of {}.",
                self.ee_llm.output_tokens
            );
        }
        let _ = writeln!(
            s,
            "\nBits per byte: −Σ log₂ p of the generated tokens, p from the distribution each token was sampled from (the depth that emitted it), over the UTF-8 bytes of the generated text; Δ vs full subtracts vanilla's (the best single model at full depth, same prompts). Every request arrives at the start (TTFT and latency include queueing); EE-LLM serves one request at a time with every layer loaded, its resident memory the weights plus the K/V of its longest sequence."
        );
        if !self.ablations.is_empty() {
            let _ = writeln!(s, "\n#### Ablations (same trace)\n");
            let _ = writeln!(s, "| variant | tokens/s | TPOT P50 / P99 (ms) | earliest exit | full depth | bits/byte | Δ vs full | largest batch | profiles | extends | switches |");
            let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|---|---|");
            for a in &self.ablations {
                let _ = writeln!(
                    s,
                    "| {} | {:.2} | {:.1} / {:.1} | {:.1}% | {:.1}% | {:.4} | {:+.4} | {} | {} | {} | {} |",
                    a.label,
                    a.output_tokens_per_s,
                    a.tpot_p50_s * 1e3,
                    a.tpot_p99_s * 1e3,
                    100.0 * a.earliest_exit_share,
                    100.0 * a.full_depth_share,
                    a.bits_per_byte,
                    a.bits_per_byte_vs_full,
                    a.largest_batch,
                    a.decisions.profiles,
                    a.decisions.extends,
                    a.decisions.switches
                );
            }
        }
        s
    }

    /// PNG charts into `dir`: latency and TTFT distributions per system, the cumulative
    /// share of tokens by depth (as a fraction of the serving model's layers), and, with
    /// ablations, tokens/s against threshold, RI and CBCmax.
    pub fn plot(&self, dir: &Path) -> Result<Vec<PathBuf>> {
        std::fs::create_dir_all(dir).map_err(|source| HeliosError::Io {
            path: dir.to_path_buf(),
            source,
        })?;
        let text = fonts_available();
        let systems: Vec<_> = [&self.vanilla, &self.ee_llm, &self.helios]
            .into_iter()
            .chain(self.helios_serial.as_ref())
            .collect();
        let mut written = Vec::new();
        let cdf = |f: fn(&RequestRecord) -> Option<f64>| -> Vec<Series> {
            systems
                .iter()
                .map(|r| {
                    let mut xs: Vec<f64> = r.per_request.iter().filter_map(f).collect();
                    xs.sort_by(f64::total_cmp);
                    let n = xs.len().max(1) as f64;
                    Series {
                        name: r.system.clone(),
                        points: xs
                            .iter()
                            .enumerate()
                            .map(|(i, &x)| (x, (i + 1) as f64 / n))
                            .collect(),
                    }
                })
                .collect()
        };
        for (file, title, x_label, f) in [
            (
                "latency.png",
                "Request latency",
                "seconds from the start",
                (|r: &RequestRecord| Some(r.latency_s)) as fn(&RequestRecord) -> Option<f64>,
            ),
            ("ttft.png", "Time to first token", "seconds", |r| r.ttft_s),
            ("tpot.png", "Time per output token", "seconds", |r| r.tpot_s),
        ] {
            let series = cdf(f);
            let x_max = series
                .iter()
                .flat_map(|s| s.points.iter().map(|p| p.0))
                .fold(0.0, f64::max);
            let path = dir.join(file);
            line_chart(
                &path,
                &Chart {
                    title,
                    x_label,
                    y_label: "share of requests",
                    x: (0.0, x_max.max(1e-3) * 1.05),
                    y: (0.0, 1.0),
                    series: &series,
                    legend: plotters::prelude::SeriesLabelPosition::LowerRight,
                },
                text,
            )?;
            written.push(path);
        }
        let depth_series: Vec<Series> = systems
            .iter()
            .map(|r| {
                let mut fr: Vec<(f64, u64)> = r
                    .depth_counts
                    .iter()
                    .map(|c| (c.depth as f64 / c.layers.max(1) as f64, c.tokens))
                    .collect();
                fr.sort_by(|a, b| a.0.total_cmp(&b.0));
                let total = r.output_tokens.max(1) as f64;
                let mut acc = 0u64;
                let mut points: Vec<(f64, f64)> = Vec::new();
                for (x, t) in fr {
                    acc += t;
                    let y = acc as f64 / total;
                    // Two models at the same fraction of their layers are one point.
                    match points.last_mut() {
                        Some(p) if p.0 == x => p.1 = y,
                        _ => points.push((x, y)),
                    }
                }
                Series {
                    name: r.system.clone(),
                    points,
                }
            })
            .collect();
        let path = dir.join("depth.png");
        line_chart(
            &path,
            &Chart {
                title: "Tokens by exit depth",
                x_label: "depth / layers of the serving model",
                y_label: "cumulative share of tokens",
                x: (0.0, 1.05),
                y: (0.0, 1.05),
                series: &depth_series,
                legend: plotters::prelude::SeriesLabelPosition::UpperLeft,
            },
            text,
        )?;
        written.push(path);
        let sweep = |prefix: &str, x: fn(&AblationRow) -> f64| -> Vec<(f64, f64)> {
            self.ablations
                .iter()
                .filter(|a| a.label.starts_with(prefix))
                .map(|a| (x(a), a.output_tokens_per_s))
                .collect()
        };
        for (file, title, x_label, prefix, x) in [
            (
                "ablation-threshold.png",
                "HELIOS tokens/s by confidence threshold",
                "threshold",
                "threshold",
                (|a: &AblationRow| f64::from(a.threshold)) as fn(&AblationRow) -> f64,
            ),
            (
                "ablation-ri.png",
                "HELIOS tokens/s by re-profiling interval",
                "RI (requests)",
                "RI",
                |a| a.reprofile_interval as f64,
            ),
            (
                "ablation-cbc.png",
                "HELIOS tokens/s by CBCmax",
                "CBCmax (breaches per 100 tokens)",
                "CBCmax",
                |a| a.cbc_max as f64,
            ),
        ] {
            let points = sweep(prefix, x);
            if points.is_empty() {
                continue;
            }
            let (x_lo, x_hi) = points
                .iter()
                .fold((f64::INFINITY, f64::NEG_INFINITY), |(l, h), p| {
                    (l.min(p.0), h.max(p.0))
                });
            let y_hi = points.iter().map(|p| p.1).fold(0.0, f64::max);
            let pad = ((x_hi - x_lo) * 0.05).max(1e-3);
            let path = dir.join(file);
            line_chart(
                &path,
                &Chart {
                    title,
                    x_label,
                    y_label: "output tokens/s",
                    x: (x_lo - pad, x_hi + pad),
                    y: (0.0, y_hi.max(1e-3) * 1.1),
                    series: &[Series {
                        name: "HELIOS".into(),
                        points,
                    }],
                    legend: plotters::prelude::SeriesLabelPosition::LowerRight,
                },
                text,
            )?;
            written.push(path);
        }
        Ok(written)
    }
}
