//! HumanEval pass@1: a completion passes when the problem's own tests run without error
//! after it, executed by `python3` in a subprocess with a timeout, in a fresh temporary
//! folder, in Python's isolated mode, and with no network where the machine allows it
//! (`unshare -rn`: a user and network namespace of its own).
//!
//! Completions are cut where the function ends, at HumanEval's stop sequences (a new
//! top-level statement), as the original evaluation does.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::quality::tasks::HumanEvalItem;
use crate::{EvalError, Result};

/// Where a completion of a HumanEval prompt ends: a new top-level statement, or a Markdown
/// fence (instruct models close their code blocks).
pub const HUMANEVAL_STOP: &[&str] = &[
    "\ndef ",
    "\nclass ",
    "\nif __name__",
    "\nprint(",
    "\n#",
    "\n```",
];

/// How long one problem's tests may run.
pub const TEST_TIMEOUT: Duration = Duration::from_secs(10);

/// `completion` cut at the first stop sequence.
pub fn truncate_completion(completion: &str) -> &str {
    let end = HUMANEVAL_STOP
        .iter()
        .filter_map(|s| completion.find(s))
        .min()
        .unwrap_or(completion.len());
    &completion[..end]
}

/// How the tests are run on this machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum Isolation {
    /// `unshare -rn`: no network.
    NoNetwork,
    /// `unshare` is refused here: the tests run with the machine's network (HumanEval's tests
    /// open no connections).
    Plain,
}

impl Isolation {
    /// Whether `unshare -rn` works on this machine.
    pub fn detect() -> Self {
        let ok = Command::new("unshare")
            .args(["-rn", "python3", "-I", "-c", "pass"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if ok {
            Self::NoNetwork
        } else {
            Self::Plain
        }
    }
}

/// The outcome of one problem's tests.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub enum Outcome {
    Passed,
    /// The tests raised, or Python exited non-zero; the last line of its error output.
    Failed(String),
    TimedOut,
}

impl Outcome {
    pub fn passed(&self) -> bool {
        matches!(self, Self::Passed)
    }
}

/// Runs `item`'s tests on `prompt + truncate_completion(completion)`.
pub fn run_tests(item: &HumanEvalItem, completion: &str, isolation: Isolation) -> Result<Outcome> {
    let program = format!(
        "{}{}\n\n{}\n\ncheck({})\n",
        item.prompt,
        truncate_completion(completion),
        item.test,
        item.entry_point
    );
    let dir = tempfile::tempdir().map_err(|source| EvalError::Io {
        path: std::env::temp_dir(),
        source,
    })?;
    let file = dir.path().join("program.py");
    let io = |path: PathBuf| move |source| EvalError::Io { path, source };
    std::fs::File::create(&file)
        .and_then(|mut f| f.write_all(program.as_bytes()))
        .map_err(io(file.clone()))?;
    let mut cmd = match isolation {
        Isolation::NoNetwork => {
            let mut c = Command::new("unshare");
            c.args(["-rn", "python3"]);
            c
        }
        Isolation::Plain => Command::new("python3"),
    };
    let mut child = cmd
        .arg("-I")
        .arg(&file)
        .current_dir(dir.path())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(io(PathBuf::from("python3")))?;
    let start = Instant::now();
    loop {
        match child.try_wait().map_err(io(PathBuf::from("python3")))? {
            Some(status) if status.success() => return Ok(Outcome::Passed),
            Some(_) => {
                let mut err = String::new();
                if let Some(mut e) = child.stderr.take() {
                    let _ = std::io::Read::read_to_string(&mut e, &mut err);
                }
                let last = err.lines().last().unwrap_or("no error output").to_string();
                return Ok(Outcome::Failed(last));
            }
            None if start.elapsed() > TEST_TIMEOUT => {
                let _ = child.kill();
                let _ = child.wait();
                return Ok(Outcome::TimedOut);
            }
            None => std::thread::sleep(Duration::from_millis(10)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item() -> HumanEvalItem {
        HumanEvalItem {
            task_id: "t/0".into(),
            prompt: "def add(a, b):\n    \"\"\"Sum of a and b.\"\"\"\n".into(),
            canonical_solution: "    return a + b\n".into(),
            test: "def check(f):\n    assert f(2, 3) == 5\n    assert f(-1, 1) == 0\n".into(),
            entry_point: "add".into(),
        }
    }

    #[test]
    fn completions_are_cut_where_the_function_ends() {
        assert_eq!(
            truncate_completion("    return a + b\n\ndef other():\n    pass"),
            "    return a + b\n"
        );
        assert_eq!(
            truncate_completion("    return 1\n```\nDone."),
            "    return 1"
        );
        assert_eq!(truncate_completion("    return 1"), "    return 1");
    }

    #[test]
    fn tests_pass_fail_and_time_out() {
        let iso = Isolation::detect();
        let it = item();
        assert_eq!(
            run_tests(&it, &it.canonical_solution, iso).expect("ran"),
            Outcome::Passed
        );
        assert_eq!(
            run_tests(&it, "    return a - b\n\nprint('never run')", iso).expect("ran"),
            Outcome::Failed("AssertionError".into())
        );
        let spin = run_tests(&it, "    while True:\n        pass\n", iso).expect("ran");
        assert_eq!(spin, Outcome::TimedOut);
    }
}
