//! What the soak reads of the server besides its answers: the process's resident memory from
//! `/proc` and the engine's gauges from `/metrics`.

use std::path::PathBuf;

use serde::Serialize;

use crate::{BenchError, Result};

/// The server's Prometheus endpoint: `explicit` when given, else `/metrics` on the host of
/// `server` (a URL of the server, its `/v1` or a completions endpoint).
pub fn metrics_url(server: &str, explicit: Option<&str>) -> Result<reqwest::Url> {
    let given = explicit.unwrap_or(server);
    let bad = |why: String| BenchError::Invalid(format!("metrics URL {given:?}: {why}"));
    let mut url = reqwest::Url::parse(given.trim()).map_err(|e| bad(e.to_string()))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(bad("expected an http:// or https:// URL".into()));
    }
    if explicit.is_none() {
        url.set_path("/metrics");
        url.set_query(None);
    }
    Ok(url)
}

/// Resident memory of a process, in bytes, from `/proc/<pid>/status`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Rss {
    pub vm_rss: u64,
    /// Anonymous pages (heap: K/V pool, workspace, copies of weights).
    pub anon: u64,
    /// File-backed pages (memory-mapped model files).
    pub file: u64,
}

/// Reads `VmRSS`, `RssAnon` and `RssFile` from the text of `/proc/<pid>/status`; `None`
/// without `VmRSS`.
pub fn parse_status(text: &str) -> Option<Rss> {
    let field = |name: &str| {
        text.lines().find_map(|l| {
            let rest = l.strip_prefix(name)?.strip_prefix(':')?;
            let kb: u64 = rest.trim().strip_suffix("kB")?.trim().parse().ok()?;
            Some(kb * 1024)
        })
    };
    Some(Rss {
        vm_rss: field("VmRSS")?,
        anon: field("RssAnon").unwrap_or(0),
        file: field("RssFile").unwrap_or(0),
    })
}

/// The resident memory of process `pid` now.
pub fn read_rss(pid: u32) -> Result<Rss> {
    let path = PathBuf::from(format!("/proc/{pid}/status"));
    let text = std::fs::read_to_string(&path).map_err(|source| BenchError::io(&path, source))?;
    parse_status(&text)
        .ok_or_else(|| BenchError::Invalid(format!("{} has no VmRSS line", path.display())))
}

/// What the server's `/metrics` says about one model's engine (and its request count).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Gauges {
    pub kv_blocks_used: u64,
    pub kv_blocks_free: u64,
    /// Of the used blocks: held by the prefix cache for later prompts.
    pub kv_blocks_prefix_cached: u64,
    pub running: u64,
    pub waiting: u64,
    pub budget_bytes: Option<u64>,
    pub weights_bytes: Option<u64>,
    /// Used and free K/V blocks together.
    pub kv_pool_bytes: Option<u64>,
    pub workspace_bytes: Option<u64>,
    /// `switchyard_requests_total` over every model, route and status.
    pub requests_total: u64,
    /// Most requests the server admitted at once for this model since it started
    /// (`switchyard_requests_in_flight_max`; `None` from a server without it).
    pub in_flight_max: Option<u64>,
}

/// One sample `name{labels} value` of the Prometheus text format.
fn metric_line(line: &str) -> Option<(&str, &str, f64)> {
    let (name, rest) = line.split_once('{')?;
    let (labels, value) = rest.rsplit_once('}')?;
    Some((name, labels, value.trim().parse().ok()?))
}

/// The value of label `key` (label values here never hold quotes or commas).
fn label<'a>(labels: &'a str, key: &str) -> Option<&'a str> {
    labels.split(',').find_map(|kv| {
        let (k, v) = kv.split_once('=')?;
        (k.trim() == key).then(|| v.trim().trim_matches('"'))
    })
}

/// Reads [`Gauges`] for `model` from a `/metrics` body; `None` when it has no
/// `switchyard_kv_blocks` for that model (not a Switchyard server, or another model).
pub fn parse_gauges(text: &str, model: &str) -> Option<Gauges> {
    let mut g = Gauges::default();
    let mut seen = false;
    let (mut kv_used_b, mut kv_free_b) = (None, None);
    for (name, labels, v) in text.lines().filter_map(metric_line) {
        if name == "switchyard_requests_total" {
            g.requests_total += v as u64;
            continue;
        }
        if label(labels, "model") != Some(model) {
            continue;
        }
        let n = v.max(0.0) as u64;
        match (name, label(labels, "state"), label(labels, "category")) {
            ("switchyard_kv_blocks", Some("used"), _) => {
                g.kv_blocks_used = n;
                seen = true;
            }
            ("switchyard_kv_blocks", Some("free"), _) => g.kv_blocks_free = n,
            ("switchyard_kv_blocks", Some("prefix_cached"), _) => g.kv_blocks_prefix_cached = n,
            ("switchyard_num_requests_running", ..) => g.running = n,
            ("switchyard_num_requests_waiting", ..) => g.waiting = n,
            ("switchyard_requests_in_flight_max", ..) => g.in_flight_max = Some(n),
            ("switchyard_memory_bytes", _, Some("budget")) => g.budget_bytes = Some(n),
            ("switchyard_memory_bytes", _, Some("weights")) => g.weights_bytes = Some(n),
            ("switchyard_memory_bytes", _, Some("kv_used")) => kv_used_b = Some(n),
            ("switchyard_memory_bytes", _, Some("kv_free")) => kv_free_b = Some(n),
            ("switchyard_memory_bytes", _, Some("workspace")) => g.workspace_bytes = Some(n),
            _ => {}
        }
    }
    g.kv_pool_bytes = kv_used_b.zip(kv_free_b).map(|(u, f)| u + f);
    seen.then_some(g)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_status_and_metrics_are_read() {
        let status = "Name:\tswitchyard\nVmHWM:\t  400 kB\nVmRSS:\t  327916 kB\nRssAnon:\t  218120 kB\nRssFile:\t  109796 kB\n";
        assert_eq!(
            parse_status(status),
            Some(Rss {
                vm_rss: 327_916 * 1024,
                anon: 218_120 * 1024,
                file: 109_796 * 1024
            })
        );
        assert_eq!(parse_status("Name: x\n"), None);
        let text = r#"# TYPE switchyard_kv_blocks gauge
switchyard_kv_blocks{model="m",state="free"} 8170
switchyard_kv_blocks{model="m",state="prefix_cached"} 3
switchyard_kv_blocks{model="m",state="used"} 7
switchyard_kv_blocks{model="other",state="used"} 99
switchyard_memory_bytes{category="budget",model="m"} 268435456
switchyard_memory_bytes{category="kv_free",model="m"} 100
switchyard_memory_bytes{category="kv_used",model="m"} 20
switchyard_num_requests_running{model="m"} 2
switchyard_num_requests_waiting{model="m"} 1
switchyard_requests_in_flight_max{model="m"} 8
switchyard_requests_in_flight_max{model="other"} 3
switchyard_requests_total{model="m",route="completions",status="200"} 5
switchyard_requests_total{model="m",route="completions",status="429"} 2
"#;
        let g = parse_gauges(text, "m").expect("gauges");
        assert_eq!(
            (
                g.kv_blocks_used,
                g.kv_blocks_free,
                g.kv_blocks_prefix_cached
            ),
            (7, 8170, 3)
        );
        assert_eq!((g.running, g.waiting, g.requests_total), (2, 1, 7));
        assert_eq!(
            (g.budget_bytes, g.kv_pool_bytes),
            (Some(1 << 28), Some(120))
        );
        assert_eq!((g.weights_bytes, g.in_flight_max), (None, Some(8)));
        assert_eq!(parse_gauges(text, "absent"), None);
    }

    #[test]
    fn metrics_urls() {
        let u = |server: &str, explicit| metrics_url(server, explicit).map(|u| u.to_string()).ok();
        assert_eq!(
            u("http://127.0.0.1:8000/v1/completions", None).as_deref(),
            Some("http://127.0.0.1:8000/metrics")
        );
        assert_eq!(
            u("http://h:1", Some("http://m:2/prom")).as_deref(),
            Some("http://m:2/prom")
        );
        assert_eq!(u("localhost:8000", None), None);
    }
}
