//! The default priority policy rule by rule, the baseline fallback, and policy files: parsing,
//! round trips and every validation message.

use switchyard_router::{
    Class, Condition, Decision, Mode, ModeSet, Policy, RequestFeatures, Router, RulesRouter,
    DEFAULT_POLICY_TOML,
};

fn req(prompt: usize, output: usize) -> RequestFeatures {
    RequestFeatures {
        prompt_tokens: prompt,
        max_output_tokens: output,
        ..Default::default()
    }
}

fn labelled(prompt: usize, output: usize, label: &str) -> RequestFeatures {
    RequestFeatures {
        workload: Some(label.into()),
        ..req(prompt, output)
    }
}

#[test]
fn each_priority_rule_fires_in_order() {
    let router = RulesRouter::default();
    let queued = RequestFeatures {
        queue_depth: 8,
        ..req(128, 32)
    };
    let chat = RequestFeatures {
        shared_prefix_tokens: 256,
        ..labelled(512, 128, "chat")
    };
    let chat_under_pressure = RequestFeatures {
        memory_pressure: 0.9,
        ..chat.clone()
    };
    let long_context = RequestFeatures {
        memory_pressure: 0.85,
        ..req(2000, 64)
    };
    let math_under_pressure = RequestFeatures {
        memory_pressure: 0.8,
        ..labelled(200, 256, "gsm8k")
    };
    let cases: Vec<(&str, RequestFeatures, Mode, &str)> = vec![
        (
            "queue depth 8",
            queued,
            Mode::Int8ContinuousBatching,
            "1:batch",
        ),
        (
            "batch label",
            labelled(1024, 256, "batch"),
            Mode::Int8ContinuousBatching,
            "1:batch",
        ),
        (
            "shared-prefix chat",
            chat,
            Mode::Q4PrefixCache,
            "2:shared-prefix",
        ),
        (
            "shared prefix beats memory pressure",
            chat_under_pressure,
            Mode::Q4PrefixCache,
            "2:shared-prefix",
        ),
        (
            "memory pressure",
            long_context,
            Mode::Q4,
            "3:memory-pressure",
        ),
        (
            "memory pressure beats math",
            math_under_pressure,
            Mode::Q4,
            "3:memory-pressure",
        ),
        (
            "synthetic SS",
            labelled(128, 32, "SS"),
            Mode::Q4,
            "4:synthetic-shape",
        ),
        (
            "synthetic LS",
            labelled(1024, 32, "LS"),
            Mode::Q4,
            "4:synthetic-shape",
        ),
        (
            "synthetic LL, though decode-heavy",
            labelled(1024, 128, "ll"),
            Mode::Q4,
            "4:synthetic-shape",
        ),
        (
            "synthetic SL is decode-heavy",
            labelled(128, 128, "SL"),
            Mode::Speculative,
            "5:decode-heavy",
        ),
        (
            "long output, no label",
            req(128, 256),
            Mode::Speculative,
            "5:decode-heavy",
        ),
        (
            "math with a short output hint",
            RequestFeatures {
                expected_output_tokens: Some(48),
                ..labelled(200, 512, "gsm8k")
            },
            Mode::Speculative,
            "5:decode-heavy",
        ),
        (
            "multiple choice on a long prompt",
            labelled(800, 16, "mmlu"),
            Mode::Int8,
            "6:multiple-choice",
        ),
        (
            "multiple choice on a short prompt",
            labelled(200, 16, "HellaSwag"),
            Mode::Int8,
            "6:multiple-choice",
        ),
        (
            "multiple choice with a long answer is decode-heavy first",
            labelled(800, 512, "arc"),
            Mode::Speculative,
            "5:decode-heavy",
        ),
        (
            "prefill-heavy, no label",
            req(1024, 32),
            Mode::Int8,
            "6:multiple-choice",
        ),
        (
            "interactive, no label",
            req(128, 32),
            Mode::Int8,
            "7:default",
        ),
        (
            "unknown label, medium output",
            labelled(300, 100, "poetry"),
            Mode::Int8,
            "7:default",
        ),
    ];
    for (name, f, mode, rule) in cases {
        let d = router.route(&f);
        assert_eq!(
            (d.mode, d.rule.as_str(), d.fallback),
            (mode, rule, false),
            "{name}"
        );
    }
}

#[test]
fn an_unavailable_mode_falls_back_to_f16() {
    let router = RulesRouter::default();
    let no_speculation = ModeSet::all().without(Mode::Speculative);
    let cases: Vec<(RequestFeatures, ModeSet, Decision)> = vec![
        (
            labelled(128, 128, "SL"),
            no_speculation,
            Decision {
                mode: Mode::F16,
                rule: "5:decode-heavy".into(),
                class: Class::DecodeHeavy,
                fallback: true,
            },
        ),
        (
            labelled(128, 32, "SS"),
            no_speculation,
            Decision {
                mode: Mode::Q4,
                rule: "4:synthetic-shape".into(),
                class: Class::Interactive,
                fallback: false,
            },
        ),
        (
            RequestFeatures {
                queue_depth: 12,
                ..req(64, 64)
            },
            [Mode::F16].into_iter().collect(),
            Decision {
                mode: Mode::F16,
                rule: "1:batch".into(),
                class: Class::Batch,
                fallback: true,
            },
        ),
    ];
    for (f, available, expected) in cases {
        assert_eq!(router.route_among(&f, available), expected, "{f:?}");
    }
}

#[test]
fn default_policy_text_is_the_default_policy() {
    let parsed = Policy::from_toml(DEFAULT_POLICY_TOML).unwrap();
    assert_eq!(parsed, Policy::default());
    assert_eq!(parsed.rules().len(), 7);
    assert_eq!(
        parsed.rules()[4].when,
        Condition::Any(vec![
            Condition::Class(Class::DecodeHeavy),
            Condition::Workload(vec!["gsm8k".into(), "math".into()]),
        ])
    );
}

#[test]
fn policy_round_trips_through_toml() {
    let text = Policy::default().to_toml().unwrap();
    assert_eq!(Policy::from_toml(&text).unwrap(), Policy::default());
}

#[test]
fn an_operator_policy_with_its_own_rules_and_thresholds() {
    let text = r#"
        [server]
        port = 8080

        [router.classifier]
        batch_queue_depth = 4

        [[router.rules]]
        id = "busy"
        when = { all = [{ class = "batch" }, { workload = ["batch"] }] }
        mode = "continuous-batching"

        [[router.rules]]
        id = "math"
        when = { workload = ["gsm8k"] }
        mode = "self-speculative"
    "#;
    let router = RulesRouter::from_toml(text).unwrap();
    assert_eq!(router.policy().classifier().batch_queue_depth, 4);
    let busy = RequestFeatures {
        queue_depth: 4,
        ..labelled(100, 10, "batch")
    };
    assert_eq!(router.route(&busy).mode, Mode::ContinuousBatching);
    assert_eq!(router.route(&busy).rule, "1:busy");
    let queued_chat = RequestFeatures {
        queue_depth: 4,
        ..labelled(100, 10, "chat")
    };
    let none = router.route(&queued_chat);
    assert_eq!(
        (none.mode, none.rule.as_str(), none.class, none.fallback),
        (Mode::F16, "none", Class::Batch, true),
        "no rule holds: the baseline stands in"
    );
    assert_eq!(
        router.route(&labelled(100, 300, "GSM8K")).rule,
        "2:math",
        "labels match case-insensitively"
    );
}

const KNOWN: &str = "f16, f32, int8, q4, q4-awq, speculative, self-speculative, prefix-cache, \
    chunked-prefill, continuous-batching, kv-compressed, q4+prefix-cache, int8+continuous-batching, \
    q4-gptq, q4-gptq+prefix-cache";

fn error_of(text: &str) -> String {
    Policy::from_toml(text).unwrap_err().to_string()
}

#[test]
fn policy_files_are_validated_with_exact_messages() {
    let rule = |id: &str, when: &str, mode: &str| {
        format!("[[router.rules]]\nid = \"{id}\"\nwhen = {when}\nmode = \"{mode}\"\n")
    };
    let cases: Vec<(String, String)> = vec![
        (
            rule("batch", r#"{ class = "batch" }"#, "int8") + &rule("chat", r#""always""#, "q5"),
            format!(r#"rule 2 ("chat"): unknown mode "q5"; known modes: {KNOWN}"#),
        ),
        (
            "[router]\n".into(),
            "router policy has no rules; add at least one [[router.rules]] entry".into(),
        ),
        (
            rule("a", r#""always""#, "int8") + &rule("a", r#""always""#, "q4"),
            r#"rule 2 ("a"): the id is used by an earlier rule"#.into(),
        ),
        (
            rule(" ", r#""always""#, "int8"),
            r#"rule 1 (" "): the id must not be empty"#.into(),
        ),
        (
            rule("x", "{ any = [] }", "int8"),
            "rule 1 (\"x\"): `any` needs at least one condition".into(),
        ),
        (
            rule(
                "x",
                r#"{ all = [{ class = "batch" }, { workload = [] }] }"#,
                "int8",
            ),
            "rule 1 (\"x\"): `workload` needs at least one label".into(),
        ),
        (
            rule("x", "{ shape = [] }", "q4"),
            "rule 1 (\"x\"): `shape` needs at least one shape".into(),
        ),
        (
            "[router.classifier]\nhigh_memory_pressure = 1.2\n".to_string()
                + &rule("x", r#""always""#, "int8"),
            "classifier.high_memory_pressure must be in [0, 1], got 1.2".into(),
        ),
        (
            rule("x", r#"{ class = "batchy" }"#, "int8"),
            "router policy: line 3: unknown variant `batchy`, expected one of `batch`, \
             `shared-prefix`, `prefill-heavy`, `decode-heavy`, `interactive`"
                .into(),
        ),
        (
            rule("x", r#"{ shape = ["XL"] }"#, "int8"),
            "router policy: line 3: unknown variant `XL`, expected one of `SS`, `SL`, `LS`, `LL`"
                .into(),
        ),
        (
            "[[router.rules]]\nid = \"x\"\nwhen = \"always\"\nmodes = \"int8\"\n".into(),
            "router policy: line 4: unknown field `modes`, expected one of `id`, `when`, `mode`"
                .into(),
        ),
        (
            "[server]\nport = 1\n".into(),
            "router policy: missing field `router`".into(),
        ),
    ];
    for (text, message) in cases {
        assert_eq!(error_of(&text), message, "policy:\n{text}");
    }
}
