//! ShareGPT conversations, the traffic of vLLM's serving benchmark: a streaming reader of the
//! JSON file, record by record, and vLLM's `benchmark_serving` sampling of (prompt, expected
//! output length) pairs.
//!
//! The file is one top-level JSON array. The zoo's copy is cut off in the middle of a record,
//! so the array is never closed: [`Records`] reads one element at a time (skipping the `[` and
//! the commas itself, since serde_json's stream deserializer does not walk into an array) and
//! ends cleanly at the broken tail, saying so ([`Records::truncated`]).

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::Path;

use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::Deserialize;
use switchyard_tokenizer::Tokenizer;

use crate::{EvalError, Result};

/// vLLM's `benchmark_serving` filters (`sample_sharegpt_requests`).
pub const MIN_PROMPT_TOKENS: usize = 4;
pub const MIN_OUTPUT_TOKENS: usize = 4;
pub const MAX_PROMPT_TOKENS: usize = 1024;
pub const MAX_TOTAL_TOKENS: usize = 2048;
/// vLLM's default `--seed`.
pub const DEFAULT_SEED: u64 = 0;

/// One ShareGPT record.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
pub struct Conversation {
    #[serde(default)]
    pub id: String,
    #[serde(default)]
    pub conversations: Vec<Turn>,
}

/// One turn: `from` is `human`, `gpt` (or `system`, ...).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
pub struct Turn {
    #[serde(default)]
    pub from: String,
    #[serde(default)]
    pub value: String,
}

impl Conversation {
    /// The first human turn and the first gpt turn after it.
    pub fn first_exchange(&self) -> Option<(&str, &str)> {
        let h = self.conversations.iter().position(|t| t.from == "human")?;
        let g = self.conversations[h + 1..]
            .iter()
            .find(|t| t.from == "gpt")?;
        Some((&self.conversations[h].value, &g.value))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Before the `[`.
    Start,
    /// After `[` or `,`: an element comes next (or `]` right after `[`).
    Element {
        first: bool,
    },
    /// After an element: `,` or `]`.
    AfterElement,
    Done,
}

/// The records of a ShareGPT file, one at a time.
pub struct Records<R> {
    reader: R,
    state: State,
    truncated: bool,
    read: usize,
}

/// Opens `path` for reading record by record.
pub fn records(path: &Path) -> Result<Records<BufReader<File>>> {
    let f = File::open(path).map_err(|source| EvalError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    Ok(Records::new(BufReader::with_capacity(1 << 20, f)))
}

impl<R: BufRead> Records<R> {
    pub fn new(reader: R) -> Self {
        Self {
            reader,
            state: State::Start,
            truncated: false,
            read: 0,
        }
    }

    /// Whether the array ended in the middle (the file was cut off); set once the iterator
    /// has ended.
    pub fn truncated(&self) -> bool {
        self.truncated
    }

    /// Complete records read so far.
    pub fn records_read(&self) -> usize {
        self.read
    }

    /// The next byte that is not whitespace, not consumed; `None` at the end of the input.
    fn peek(&mut self) -> Result<Option<u8>> {
        loop {
            let buf = self.reader.fill_buf().map_err(io_error)?;
            let Some(&b) = buf.first() else {
                return Ok(None);
            };
            if b.is_ascii_whitespace() {
                self.reader.consume(1);
            } else {
                return Ok(Some(b));
            }
        }
    }

    fn element(&mut self) -> Option<Result<Conversation>> {
        let mut de = serde_json::Deserializer::from_reader(&mut self.reader);
        match Conversation::deserialize(&mut de) {
            Ok(c) => {
                self.state = State::AfterElement;
                self.read += 1;
                Some(Ok(c))
            }
            Err(e) if e.is_eof() => {
                self.state = State::Done;
                self.truncated = true;
                None
            }
            Err(e) => {
                self.state = State::Done;
                Some(Err(EvalError::Invalid(format!(
                    "ShareGPT record {}: {e}",
                    self.read + 1
                ))))
            }
        }
    }
}

impl<R: BufRead> Iterator for Records<R> {
    type Item = Result<Conversation>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            let b = match self.peek() {
                Ok(b) => b,
                Err(e) => {
                    self.state = State::Done;
                    return Some(Err(e));
                }
            };
            let fail = |what: String| Some(Err(EvalError::Invalid(what)));
            match (self.state, b) {
                (State::Done, _) => return None,
                (_, None) => {
                    // The array was never closed.
                    self.truncated = self.state != State::Start || self.read > 0;
                    self.state = State::Done;
                    return None;
                }
                (State::Start, Some(b'[')) => {
                    self.reader.consume(1);
                    self.state = State::Element { first: true };
                }
                (State::Start, Some(c)) => {
                    self.state = State::Done;
                    return fail(format!(
                        "a ShareGPT file is a JSON array; it starts with {:?}",
                        c as char
                    ));
                }
                (State::Element { first: true } | State::AfterElement, Some(b']')) => {
                    self.reader.consume(1);
                    self.state = State::Done;
                    return None;
                }
                (State::AfterElement, Some(b',')) => {
                    self.reader.consume(1);
                    self.state = State::Element { first: false };
                }
                (State::Element { .. }, Some(_)) => return self.element(),
                (State::AfterElement, Some(c)) => {
                    self.state = State::Done;
                    return fail(format!(
                        "after ShareGPT record {}: expected ',' or ']', found {:?}",
                        self.read, c as char
                    ));
                }
            }
        }
    }
}

fn io_error(source: std::io::Error) -> EvalError {
    EvalError::Io {
        path: "sharegpt".into(),
        source,
    }
}

/// How to sample requests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SampleOptions {
    pub num_prompts: usize,
    pub seed: u64,
}

/// A benchmark request: the prompt and how many tokens the dataset's answer had.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SampledRequest {
    pub prompt: String,
    /// The prompt tokenized as the model sees it (BOS included when the model adds one).
    pub prompt_tokens: Vec<u32>,
    /// Tokens of the first gpt answer: the output length to generate.
    pub output_len: usize,
    /// That answer's text (a reference to score, never a target to match).
    pub answer: String,
}

/// A sample and where it came from.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub requests: Vec<SampledRequest>,
    /// Complete records in the file.
    pub records: usize,
    /// Whether the file was cut off mid-record.
    pub truncated: bool,
    /// Exchanges tokenized before `num_prompts` passed the filters.
    pub examined: usize,
}

/// vLLM's ShareGPT sampling: first exchange of every record, seeded shuffle, then in that
/// order keep those whose prompt has 4..=1024 tokens, whose answer has at least 4, and whose
/// prompt + answer fit 2048, until `num_prompts` are kept. (The shuffle is rand's, so the
/// sample differs from vLLM's Python one for the same seed.)
pub fn sample_requests(path: &Path, tokenizer: &Tokenizer, opts: &SampleOptions) -> Result<Sample> {
    let mut recs = records(path)?;
    let mut pairs: Vec<(String, String)> = Vec::new();
    for r in recs.by_ref() {
        let c = r?;
        if let Some((p, a)) = c.first_exchange() {
            pairs.push((p.to_string(), a.to_string()));
        }
    }
    let (records, truncated) = (recs.records_read(), recs.truncated());
    let mut rng = rand::rngs::StdRng::seed_from_u64(opts.seed);
    pairs.shuffle(&mut rng);
    let mut requests = Vec::with_capacity(opts.num_prompts);
    let mut examined = 0;
    for (prompt, answer) in pairs {
        if requests.len() == opts.num_prompts {
            break;
        }
        examined += 1;
        let prompt_tokens = tokenizer.encode(&prompt, true, false)?;
        let output_len = tokenizer.encode(&answer, false, false)?.len();
        let p = prompt_tokens.len();
        if p < MIN_PROMPT_TOKENS || output_len < MIN_OUTPUT_TOKENS {
            continue;
        }
        if p > MAX_PROMPT_TOKENS || p + output_len > MAX_TOTAL_TOKENS {
            continue;
        }
        requests.push(SampledRequest {
            prompt,
            prompt_tokens,
            output_len,
            answer,
        });
    }
    Ok(Sample {
        requests,
        records,
        truncated,
        examined,
    })
}

/// What a prompt is about, for traces that change domain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PromptKind {
    /// English prose with no code in it.
    Prose,
    /// A prompt carrying code: a fenced block, or at least three lines that read as code.
    Code,
}

/// A line that reads as code in the common languages of ShareGPT's programming questions.
fn code_line(line: &str) -> bool {
    let t = line.trim();
    const STARTS: &[&str] = &[
        "def ",
        "import ",
        "from ",
        "#include",
        "function ",
        "public ",
        "private ",
        "class ",
        "return ",
        "const ",
        "let ",
        "var ",
        "for (",
        "if (",
        "while (",
        "print(",
        "console.",
        "SELECT ",
        "<div",
        "fn ",
        "package ",
        "using ",
        "@",
    ];
    STARTS.iter().any(|s| t.starts_with(s))
        || (t.len() > 1 && (t.ends_with(';') || t.ends_with('{') || t == "}" || t == "};"))
}

/// The kind of `prompt`, or `None` when it is neither clean prose (mostly ASCII, no code
/// line, no code or markup marks, no programming topic) nor code.
pub fn prompt_kind(prompt: &str) -> Option<PromptKind> {
    let code_lines = prompt.lines().filter(|l| code_line(l)).count();
    if prompt.contains("```") || code_lines >= 3 {
        return Some(PromptKind::Code);
    }
    let ascii = prompt.bytes().filter(u8::is_ascii).count();
    // Prose has none of the marks of code, markup or formulas, and names no programming
    // topic (technical questions read as code to a small model even without a code line).
    const MARKS: &[char] = &[
        '`', '\\', '_', '{', '}', '[', ']', '<', '>', '$', '=', '#', '|',
    ];
    const TOPICS: &[&str] = &[
        "code",
        "python",
        "javascript",
        "java",
        "typescript",
        "function",
        "sql",
        "query",
        "array",
        "api",
        "html",
        "css",
        "json",
        "regex",
        "linux",
        "server",
        "database",
        "script",
        "program",
        "compile",
        "variable",
        "class",
        "npm",
        "aws",
        "latex",
        "excel",
        "formula",
    ];
    let lower = prompt.to_lowercase();
    let topical = lower
        .split(|c: char| !c.is_ascii_alphanumeric())
        .any(|w| TOPICS.contains(&w));
    let clean = code_lines == 0 && !prompt.contains(MARKS) && !prompt.contains("()") && !topical;
    (clean && ascii * 100 >= prompt.len() * 98).then_some(PromptKind::Prose)
}

/// The first `n` first exchanges of `kind` whose prompt has `min_bytes..=max_bytes` bytes,
/// in the file's order after a seeded shuffle (as [`sample_requests`] shuffles).
pub fn exchanges_of_kind(
    path: &Path,
    kind: PromptKind,
    n: usize,
    bytes: std::ops::RangeInclusive<usize>,
    seed: u64,
) -> Result<Vec<(String, String)>> {
    let mut pairs: Vec<(String, String)> = Vec::new();
    for r in records(path)? {
        let c = r?;
        if let Some((p, a)) = c.first_exchange() {
            if bytes.contains(&p.len()) && !a.is_empty() && prompt_kind(p) == Some(kind) {
                pairs.push((p.to_string(), a.to_string()));
            }
        }
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    pairs.shuffle(&mut rng);
    pairs.truncate(n);
    Ok(pairs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompts_are_told_apart_as_prose_or_code() {
        assert_eq!(
            prompt_kind("Write a short poem about the sea at night."),
            Some(PromptKind::Prose)
        );
        assert_eq!(
            prompt_kind("Fix this:\n```\nx = 1\n```"),
            Some(PromptKind::Code)
        );
        let js = "why does this fail?\nconst a = 1;\nlet b = a + 1;\nconsole.log(b)";
        assert_eq!(prompt_kind(js), Some(PromptKind::Code));
        assert_eq!(prompt_kind("one line;\nthen words"), None, "one code line");
        assert_eq!(
            prompt_kind("기계 학습이란 무엇인가요?"),
            None,
            "not English"
        );
        assert_eq!(
            prompt_kind("write a function in C"),
            None,
            "a programming topic"
        );
        assert_eq!(prompt_kind("a table \\begin{tabular}"), None, "markup");
    }

    fn read(text: &str) -> (Vec<Conversation>, bool, Option<String>) {
        let mut r = Records::new(text.as_bytes());
        let mut out = Vec::new();
        let mut err = None;
        for c in r.by_ref() {
            match c {
                Ok(c) => out.push(c),
                Err(e) => err = Some(e.to_string()),
            }
        }
        (out, r.truncated(), err)
    }

    const REC: &str = r#"{"id": "a", "conversations": [{"from": "human", "value": "hi [,]"}, {"from": "gpt", "value": "yo \"}"}]}"#;

    #[test]
    fn reads_a_whole_array_and_stops_at_a_cut_tail() {
        let whole = format!("[\n  {REC},\n  {REC}\n]\n");
        let (recs, truncated, err) = read(&whole);
        assert_eq!((recs.len(), truncated, err), (2, false, None));
        assert_eq!(recs[0].first_exchange(), Some(("hi [,]", "yo \"}")));
        // Cut anywhere inside the third record: two records, truncated, no error.
        let three = format!("[{REC}, {REC}, {REC}]");
        let start = three.rfind("{\"id\"").expect("third");
        for cut in [
            start,
            start + 1,
            start + 30,
            three.len() - 3,
            three.len() - 2,
        ] {
            let (recs, truncated, err) = read(&three[..cut]);
            assert_eq!(
                (recs.len(), truncated, err),
                (2, true, None),
                "cut at {cut}"
            );
        }
        // Only the closing bracket missing: three records, still an unclosed array.
        let (recs, truncated, _) = read(&three[..three.len() - 1]);
        assert_eq!((recs.len(), truncated), (3, true));
        // Cut right after a comma or a record.
        let (recs, truncated, _) = read(&format!("[{REC},"));
        assert_eq!((recs.len(), truncated), (1, true));
        let (recs, truncated, _) = read(&format!("[{REC}"));
        assert_eq!((recs.len(), truncated), (1, true));
        let (recs, truncated, err) = read("[]");
        assert_eq!((recs.len(), truncated, err), (0, false, None));
    }

    #[test]
    fn malformed_input_is_an_error_naming_the_record() {
        let (_, _, err) = read("{\"id\": 1}");
        assert!(err.expect("error").contains("JSON array"));
        let (recs, _, err) = read(&format!("[{REC} {REC}]"));
        assert_eq!(recs.len(), 1);
        assert!(err.expect("error").contains("expected ',' or ']'"));
        let (recs, _, err) = read(&format!("[{REC}, {{\"id\": 5}}]"));
        assert_eq!(recs.len(), 1);
        assert!(err.expect("error").contains("ShareGPT record 2"));
    }

    #[test]
    fn first_exchange_skips_leading_gpt_turns() {
        let t = |from: &str, value: &str| Turn {
            from: from.into(),
            value: value.into(),
        };
        let c = Conversation {
            id: "x".into(),
            conversations: vec![
                t("gpt", "g0"),
                t("human", "h1"),
                t("human", "h2"),
                t("gpt", "g1"),
            ],
        };
        assert_eq!(c.first_exchange(), Some(("h1", "g1")));
        let c = Conversation {
            id: "y".into(),
            conversations: vec![t("human", "h")],
        };
        assert_eq!(c.first_exchange(), None);
    }
}
