//! Quality measurements for the mode × workload matrix: benchmark items (ARC-Challenge,
//! HellaSwag, MMLU, GSM8K, HumanEval) read from the zoo's files, multiple-choice scoring through any
//! [`LogLikelihood`], GSM8K exact match, ROUGE-L, and 95% intervals.
//!
//! Every mode is scored on the *same* items (the loaders pick items deterministically), so two
//! modes compare item by item with [`paired_diff95`] rather than by two overlapping intervals.
//! Generation is the caller's: the bench decides which mode generates, this module only scores
//! the text.

pub mod gsm8k;
pub mod humaneval;
pub mod interval;
pub mod loglik;
pub mod mc;
pub mod rouge;
pub mod tasks;

pub use gsm8k::{
    extract_answer, gsm8k_correct, score_gen, GenScore, GSM8K_MAX_NEW_TOKENS, GSM8K_STOP,
};
pub use humaneval::{run_tests, truncate_completion, Isolation, Outcome, HUMANEVAL_STOP};
pub use interval::{mcnemar, mcnemar_p, paired_diff95, wilson95, McNemar, Z95};
pub use loglik::{encode_pair, LayeredScorer, LogLikelihood};
pub use mc::{score_item, score_mc, ItemScore, McScore};
pub use rouge::{rouge_l, rouge_l_score, rouge_tokens, RougeScore};
pub use tasks::{
    load_gsm8k, load_humaneval, load_mc, read_gsm8k, read_humaneval, read_mc, GenItem,
    HumanEvalItem, McItem, McTask, Pick,
};
