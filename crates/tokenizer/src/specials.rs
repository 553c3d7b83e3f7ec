//! BOS/EOS and end-of-generation tokens, found the way llama.cpp's `llama_vocab::load` finds them.

use std::collections::BTreeSet;

use crate::vocab::{TokenAttr, Vocab};

/// Texts llama.cpp treats as end of turn when no `eot_token_id` is given.
const EOT_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
];
const EOM_TEXTS: &[&str] = &["<|eom_id|>"];
const FIM_PAD_TEXTS: &[&str] = &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"];
const FIM_REP_TEXTS: &[&str] = &[
    "<|fim_repo|>",
    "<|repo_name|>",
    "<fim-repo>",
    "<REPO>",
    "<reponame>",
];
const FIM_SEP_TEXTS: &[&str] = &["<|file_sep|>"];

/// Texts that end generation wherever they appear in a vocabulary (llama.cpp's EOG list).
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];

/// gpt-oss channel markers that llama.cpp always renders (user-defined, never hidden).
const ALWAYS_RENDERED: &[&str] = &["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"];

/// Special-token ids a format states outright (GGUF keys, or `tokenizer_config.json`).
#[derive(Debug, Clone, Default)]
pub(crate) struct DeclaredIds {
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub eot: Option<u32>,
    pub eom: Option<u32>,
    pub fim_pad: Option<u32>,
    pub fim_rep: Option<u32>,
    pub fim_sep: Option<u32>,
}

#[derive(Debug, Clone)]
pub(crate) struct Specials {
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub add_bos: bool,
    pub add_eos: bool,
    pub eog: BTreeSet<u32>,
}

/// Lowest id among tokens whose text is in `texts` (llama.cpp takes whichever its hash map
/// yields first; the lowest id is a deterministic stand-in).
fn find_text(vocab: &Vocab, texts: &[&str]) -> Option<u32> {
    texts.iter().filter_map(|t| vocab.id(t)).min()
}

fn mark_control(vocab: &mut Vocab, id: u32) {
    if let Some(attr) = vocab.attr(id) {
        if !attr.has(TokenAttr::CONTROL) {
            tracing::debug!(
                id,
                text = vocab.piece(id).unwrap_or_default(),
                "control-looking token was not control-type; overriding, as llama.cpp does"
            );
            vocab.set_attr(id, attr.with(TokenAttr::CONTROL));
        }
    }
}

/// Applies llama.cpp's text-based detection of end-of-turn, FIM and end-of-generation tokens
/// (which also turns such tokens into control tokens), then rebuilds the special-token cache.
pub(crate) fn resolve(
    vocab: &mut Vocab,
    declared: &DeclaredIds,
    add_bos: bool,
    add_eos: bool,
) -> Specials {
    let n_vocab = vocab.len();
    let in_range = |id: Option<u32>| id.filter(|&i| (i as usize) < n_vocab);
    let bos = in_range(declared.bos);
    let eos = in_range(declared.eos);

    let mut detect = |declared: Option<u32>, texts: &[&str]| -> Option<u32> {
        if let Some(id) = in_range(declared) {
            return Some(id);
        }
        let found = find_text(vocab, texts);
        if let Some(id) = found {
            mark_control(vocab, id);
        }
        found
    };
    let eot = detect(declared.eot, EOT_TEXTS);
    let eom = detect(declared.eom, EOM_TEXTS);
    let fim_pad = detect(declared.fim_pad, FIM_PAD_TEXTS);
    let fim_rep = detect(declared.fim_rep, FIM_REP_TEXTS);
    let fim_sep = detect(declared.fim_sep, FIM_SEP_TEXTS);

    let mut eog: BTreeSet<u32> = [fim_pad, fim_rep, fim_sep].into_iter().flatten().collect();
    for text in EOG_TEXTS {
        if let Some(id) = vocab.id(text) {
            eog.insert(id);
            mark_control(vocab, id);
        }
    }
    for text in ALWAYS_RENDERED {
        if let Some(id) = vocab.id(text) {
            vocab.set_attr(id, TokenAttr::USER_DEFINED);
        }
    }
    eog.extend([eos, eot, eom].into_iter().flatten());

    // Gemma 4 workaround in llama.cpp: `</s>` is not EOG when `<|tool_response>` exists.
    if let (Some(s), Some(_)) = (vocab.id("</s>"), vocab.id("<|tool_response>")) {
        if eog.remove(&s) {
            vocab.set_attr(s, TokenAttr::NORMAL);
        }
    }
    vocab.rebuild_special_cache();

    let add_bos = if add_bos && bos.is_none() {
        tracing::warn!("the tokenizer asks for a BOS token but names none; not adding one");
        false
    } else {
        add_bos
    };
    let add_eos = if add_eos && eos.is_none() {
        tracing::warn!("the tokenizer asks for an EOS token but names none; not adding one");
        false
    } else {
        add_eos
    };
    Specials {
        bos,
        eos,
        add_bos,
        add_eos,
        eog,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn end_of_turn_texts_become_control_and_eog() {
        let pieces: Vec<String> = ["<|endoftext|>", "<|im_end|>", "hello", "<reponame>", "</s>"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let attrs = vec![
            TokenAttr::CONTROL,
            TokenAttr::NORMAL,
            TokenAttr::NORMAL,
            TokenAttr::CONTROL,
            TokenAttr::NORMAL,
        ];
        let mut v = Vocab::new(pieces, attrs).expect("valid vocab");
        let declared = DeclaredIds {
            bos: Some(0),
            eos: Some(1),
            ..Default::default()
        };
        let s = resolve(&mut v, &declared, false, false);
        assert_eq!(s.eog.iter().copied().collect::<Vec<_>>(), vec![0, 1, 3, 4]);
        assert_eq!(v.attr(1), Some(TokenAttr::NORMAL.with(TokenAttr::CONTROL)));
        assert_eq!(v.attr(2), Some(TokenAttr::NORMAL));
        assert_eq!(v.partition("a</s>", true), {
            use crate::vocab::Fragment;
            vec![Fragment::Text("a"), Fragment::Token(4)]
        });
    }

    #[test]
    fn out_of_range_ids_are_dropped() {
        let mut v = Vocab::new(vec!["a".into()], vec![TokenAttr::NORMAL]).expect("valid vocab");
        let declared = DeclaredIds {
            bos: Some(11),
            eos: Some(11),
            ..Default::default()
        };
        let s = resolve(&mut v, &declared, true, false);
        assert_eq!((s.bos, s.eos, s.add_bos), (None, None, false));
        assert!(s.eog.is_empty());
    }
}
