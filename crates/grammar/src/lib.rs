//! Constrained decoding (structured outputs): a [`Guide`] — a JSON schema, a regular
//! expression, a list of choices or a Lark grammar — becomes, at each position, the set of the
//! model's tokens that keep the output valid.
//!
//! The grammar engine is `llguidance` (the library llama.cpp, vLLM and SGLang use): it walks a
//! trie of the vocabulary's byte strings against an Earley parser with lazy lexers, so a mask
//! over 150k tokens costs well under a millisecond for typical JSON schemas. This crate builds
//! that trie from Switchyard's own tokenizer (the bytes each token renders as, control tokens
//! marked) so masks are over exactly the ids the model samples.
//!
//! API boundary: a [`Guide`] and token ids in; masks (as logits set to −∞) and validity out.

use std::sync::{Arc, OnceLock};

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use switchyard_request::Guide;
use switchyard_tokenizer::Tokenizer;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GrammarError {
    /// The guide does not compile (a bad schema, regex or grammar).
    #[error("invalid {kind}: {detail}")]
    Invalid { kind: &'static str, detail: String },
    /// The tokenizer has no end-of-sequence token to end a constrained output with.
    #[error("the tokenizer has no end-of-sequence token; constrained decoding needs one")]
    NoEos,
    /// The parser failed while generating (it reports why).
    #[error("constrained decoding failed: {0}")]
    Parser(String),
}

pub type Result<T> = std::result::Result<T, GrammarError>;

/// JSON outputs are compact (no whitespace between tokens, as vLLM's
/// `disable_any_whitespace`): with whitespace allowed, small models pad objects with blank
/// lines until `max_tokens` cuts them off. A schema's own top-level `x-guidance` settings
/// take precedence (`{"whitespace_flexible": true}` allows any).
pub fn json_layout() -> serde_json::Value {
    serde_json::json!({ "whitespace_flexible": false })
}

/// Most choices in one `guided_choice`.
pub const MAX_CHOICES: usize = 1024;

/// Compiles guides for one model's tokenizer. The vocabulary trie is built on first use (tens
/// of milliseconds for 150k tokens) and shared by every request after.
pub struct GrammarCompiler {
    tokenizer: Arc<Tokenizer>,
    factory: OnceLock<std::result::Result<ParserFactory, GrammarError>>,
}

impl std::fmt::Debug for GrammarCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarCompiler")
            .field("ready", &self.factory.get().is_some())
            .finish()
    }
}

impl GrammarCompiler {
    pub fn new(tokenizer: Arc<Tokenizer>) -> Self {
        Self {
            tokenizer,
            factory: OnceLock::new(),
        }
    }

    fn factory(&self) -> Result<&ParserFactory> {
        self.factory
            .get_or_init(|| {
                let env = SwitchyardTokEnv::new(Arc::clone(&self.tokenizer))?;
                let env: TokEnv = Arc::new(env);
                let mut factory = ParserFactory::new_simple(&env).map_err(|e| {
                    GrammarError::Parser(format!("building the grammar engine: {e}"))
                })?;
                factory.quiet();
                Ok(factory)
            })
            .as_ref()
            .map_err(Clone::clone)
    }

    /// Compiles `guide`; the error says what is wrong with it.
    pub fn compile(&self, guide: &Guide) -> Result<Constraint> {
        let kind = guide.kind();
        let invalid = |detail: String| GrammarError::Invalid { kind, detail };
        let grammar = match guide {
            Guide::JsonObject => {
                TopLevelGrammar::from_json_schema(compact(serde_json::json!({"type": "object"})))
            }
            Guide::JsonSchema(schema) => {
                if !schema.is_object() && !schema.is_boolean() {
                    return Err(invalid("a JSON schema must be an object".into()));
                }
                TopLevelGrammar::from_json_schema(compact(schema.clone()))
            }
            Guide::Regex(rx) => {
                // The regex crate's parser names the problem better than the grammar engine.
                regex_syntax::Parser::new()
                    .parse(rx)
                    .map_err(|e| invalid(e.to_string()))?;
                TopLevelGrammar::from_regex(rx)
            }
            Guide::Choice(choices) => {
                if choices.is_empty() || choices.len() > MAX_CHOICES {
                    return Err(invalid(format!(
                        "give 1 to {MAX_CHOICES} choices, got {}",
                        choices.len()
                    )));
                }
                let alternatives: Vec<String> =
                    choices.iter().map(|c| regex_syntax::escape(c)).collect();
                TopLevelGrammar::from_regex(&format!("(?:{})", alternatives.join("|")))
            }
            Guide::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
        };
        let factory = self.factory()?;
        let vocab = factory.tok_env().tok_trie().vocab_size();
        let parser = factory
            .create_parser(grammar)
            .map_err(|e| invalid(e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(invalid(e));
        }
        Ok(Constraint {
            matcher,
            prepared: None,
            vocab,
        })
    }
}

/// `schema` with [`json_layout`] unless it sets `x-guidance` itself.
fn compact(mut schema: serde_json::Value) -> serde_json::Value {
    if let Some(o) = schema.as_object_mut() {
        o.entry("x-guidance").or_insert_with(json_layout);
    }
    schema
}

/// One request's constraint as it generates.
pub struct Constraint {
    matcher: Matcher,
    /// The next position's mask, computed ahead by [`Constraint::prepare`].
    prepared: Option<SimpleVob>,
    /// Tokens in the vocabulary; ids past it (padding rows of the output matrix) are never
    /// allowed.
    vocab: usize,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("finished", &self.is_finished())
            .finish()
    }
}

impl Constraint {
    /// Computes the next position's mask now, so that [`Constraint::mask`] only applies it:
    /// the engine prepares every constrained row of a step at once on the compute pool
    /// instead of one row after another. An error is left for `mask` to report.
    pub fn prepare(&mut self) {
        if self.prepared.is_none() {
            self.prepared = self.matcher.compute_mask_or_eos().ok();
        }
    }

    /// Sets the logits of every token the constraint does not allow next to −∞. Once the
    /// output is complete only the end-of-sequence token stays.
    pub fn mask(&mut self, logits: &mut [f32]) -> Result<()> {
        let mask = match self.prepared.take() {
            Some(m) => m,
            None => self
                .matcher
                .compute_mask_or_eos()
                .map_err(|e| GrammarError::Parser(e.to_string()))?,
        };
        // Word by word: most words of a mask are all allowed (inside a JSON string, say) or
        // all banned, and cost one comparison.
        let n = logits.len();
        for (w, &bits) in mask.as_slice().iter().enumerate() {
            let start = w * 32;
            if start >= n {
                break;
            }
            let end = (start + 32).min(n);
            match bits {
                u32::MAX => {}
                0 => logits[start..end].fill(f32::NEG_INFINITY),
                _ => {
                    for (k, l) in logits[start..end].iter_mut().enumerate() {
                        if bits & (1 << k) == 0 {
                            *l = f32::NEG_INFINITY;
                        }
                    }
                }
            }
        }
        // Ids past the tokenizer's vocabulary (padding rows of the output matrix).
        logits[mask.len().min(n)..].fill(f32::NEG_INFINITY);
        Ok(())
    }

    /// Whether `token` may come next. Without a prepared mask this asks the parser about that
    /// one token (its bytes through the lexer and the Earley sets, then rolled back), which
    /// costs a small fraction of a mask over the whole vocabulary: the sampler tries the token
    /// it drew from the unmasked logits first, and computes a mask only when it is refused.
    pub fn allows(&mut self, token: u32) -> Result<bool> {
        if token as usize >= self.vocab {
            return Ok(false);
        }
        if let Some(mask) = &self.prepared {
            return Ok(mask.is_allowed(token));
        }
        if self.matcher.is_stopped() {
            // Only the end of sequence may follow; that mask is one bit, cheap to build.
            let mask = self
                .matcher
                .compute_mask_or_eos()
                .map_err(|e| GrammarError::Parser(e.to_string()))?;
            let allowed = mask.is_allowed(token);
            self.prepared = Some(mask);
            return Ok(allowed);
        }
        self.matcher
            .validate_tokens(&[token])
            .map(|n| n == 1)
            .map_err(|e| GrammarError::Parser(e.to_string()))
    }

    /// Records the sampled token (ignored once the output is complete).
    pub fn advance(&mut self, token: u32) -> Result<()> {
        self.prepared = None;
        if self.matcher.is_stopped() {
            return Ok(());
        }
        self.matcher
            .consume_token(token)
            .map_err(|e| GrammarError::Parser(e.to_string()))
    }

    /// The output is complete: only the end-of-sequence token may follow.
    pub fn is_finished(&self) -> bool {
        self.matcher.is_stopped()
    }

    /// Whether the output so far could end here.
    pub fn is_accepting(&mut self) -> bool {
        self.matcher.is_accepting().unwrap_or(false)
    }
}

/// The vocabulary as llguidance sees it: each token's bytes, control tokens behind the 0xFF
/// marker, and tokenization through Switchyard's tokenizer.
struct SwitchyardTokEnv {
    tokenizer: Arc<Tokenizer>,
    trie: TokTrie,
}

impl SwitchyardTokEnv {
    fn new(tokenizer: Arc<Tokenizer>) -> Result<Self> {
        let eos = tokenizer.eos_id().ok_or(GrammarError::NoEos)?;
        let words: Vec<Vec<u8>> = tokenizer
            .token_bytes()
            .into_iter()
            .map(|(bytes, special)| {
                if special {
                    let mut w = Vec::with_capacity(bytes.len() + 1);
                    w.push(TokTrie::SPECIAL_TOKEN_MARKER);
                    w.extend_from_slice(&bytes);
                    w
                } else {
                    bytes
                }
            })
            .collect();
        let mut info = TokRxInfo::new(words.len() as u32, eos);
        info.tok_bos = tokenizer.bos_id();
        let trie = TokTrie::from(&info, &words);
        Ok(Self { tokenizer, trie })
    }
}

impl TokenizerEnv for SwitchyardTokEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        // Text that is not UTF-8 (a cut in a character) falls back to the trie's greedy split.
        match std::str::from_utf8(s) {
            Ok(text) => self
                .tokenizer
                .encode(text, false, false)
                .unwrap_or_else(|_| self.trie.greedy_tokenize(s)),
            Err(_) => self.trie.greedy_tokenize(s),
        }
    }

    /// Tokenizing a fragment on its own is not always how it tokenizes inside a text
    /// (SentencePiece's space prefix), so the grammar engine must not force tokens from it.
    fn tokenize_is_canonical(&self) -> bool {
        false
    }
}
