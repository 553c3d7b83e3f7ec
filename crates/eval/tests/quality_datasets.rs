//! The quality matrix's items, parsed from the zoo's real dataset files: first items field by
//! field, item counts, deterministic picks, and malformed lines reported with file and line.

use std::io::Write;
use std::time::Instant;

use switchyard_eval::quality::{
    gsm8k_correct, load_gsm8k, load_mc, read_gsm8k, read_mc, McTask, Pick,
};

#[test]
fn arc_challenge_first_item_and_count() {
    let t = Instant::now();
    let items = load_mc(McTask::ArcChallenge, 2, Pick::First).expect("arc");
    let first = &items[0];
    assert_eq!(first.id, "Mercury_7175875");
    assert_eq!(first.gold, 2);
    assert_eq!(
        first.choices,
        [
            " Planetary density will decrease.",
            " Planetary years will become longer.",
            " Planetary days will become shorter.",
            " Planetary gravity will become stronger."
        ]
    );
    // Five worked examples, then the question.
    assert!(
        first.context.starts_with("Question: "),
        "{:?}",
        &first.context[..40]
    );
    assert_eq!(first.context.matches("Question: ").count(), 6);
    assert!(first.context.ends_with(
        "Question: An astronomer observes that a planet rotates faster after a meteorite \
         impact. Which is the most likely effect of this increase in rotation?\nAnswer:"
    ));
    assert_eq!(items[1].id, "Mercury_SC_409171");
    assert_eq!(items[1].gold, 1);

    let all = load_mc(McTask::ArcChallenge, usize::MAX, Pick::First).expect("arc");
    assert_eq!(all.len(), 1_172);
    let with = |k| all.iter().filter(|i| i.choices.len() == k).count();
    assert_eq!((with(3), with(4), with(5)), (4, 1_165, 3));
    assert!(all.iter().all(|i| i.gold < i.choices.len()));
    assert!(all
        .iter()
        .all(|i| i.choices.iter().all(|c| c.starts_with(' '))));
    eprintln!("arc-challenge parsed in {:.2?}", t.elapsed());
}

#[test]
fn hellaswag_first_item() {
    let items = load_mc(McTask::Hellaswag, 3, Pick::First).expect("hellaswag");
    assert_eq!(items.len(), 3);
    let first = &items[0];
    assert_eq!(first.id, "24");
    assert_eq!(
        first.context,
        "Roof shingle removal: A man is sitting on a roof. He"
    );
    assert_eq!(first.choices.len(), 4);
    assert_eq!(first.choices[0], " is using wrap to wrap a pair of skis.");
    assert_eq!(first.choices[3], " starts pulling up roofing on a roof.");
    assert_eq!(first.gold, 3);
}

#[test]
fn mmlu_first_item_count_and_seeded_pick() {
    let all = load_mc(McTask::Mmlu, usize::MAX, Pick::First).expect("mmlu");
    // 14,044 lines less the two stray header rows.
    assert_eq!(all.len(), 14_042);
    let first = &all[0];
    assert_eq!(first.id, "mmlu/moral scenarios/0");
    assert_eq!(first.gold, 3);
    assert_eq!(first.choices, [" A", " B", " C", " D"]);
    assert!(first.context.starts_with(
        "The following is a multiple choice question about moral scenarios.\n\nFor which of \
         these two scenarios does the main character"
    ));
    assert!(first.context.ends_with(
        "\nA. Wrong, Wrong\nB. Wrong, Not wrong\nC. Not wrong, Wrong\nD. Not wrong, Not \
         wrong\nAnswer:"
    ));
    let golds = |g| all.iter().filter(|i| i.gold == g).count();
    assert_eq!(
        (golds(0), golds(1), golds(2), golds(3)),
        (3_222, 3_462, 3_582, 3_776)
    );

    let a = load_mc(McTask::Mmlu, 50, Pick::Seeded(0)).expect("mmlu");
    let b = load_mc(McTask::Mmlu, 50, Pick::Seeded(0)).expect("mmlu");
    assert_eq!(a, b);
    assert_eq!(a.len(), 50);
    let topics: std::collections::HashSet<&str> = a
        .iter()
        .map(|i| i.id.split('/').nth(1).unwrap_or(""))
        .collect();
    assert!(topics.len() > 10, "{topics:?}");
}

#[test]
fn gsm8k_first_item_count_and_gold_chains_extract() {
    let items = load_gsm8k(usize::MAX, Pick::First).expect("gsm8k");
    assert_eq!(items.len(), 1_319);
    let first = &items[0];
    assert_eq!(first.id, "0");
    assert_eq!(first.answer, "18");
    assert!(first
        .prompt
        .starts_with("Question: There are 15 trees in the grove."));
    assert!(first
        .prompt
        .ends_with("How much in dollars does she make every day at the farmers' market?\nAnswer:"));
    assert_eq!(first.prompt.matches("Question: ").count(), 9);

    // The file's own gold chain of thought for each problem ("... So the answer is 18.")
    // must score correct under the extraction rule.
    let path = switchyard_zoo::ensure("gsm8k").expect("gsm8k");
    let text = {
        use std::io::Read;
        let mut s = String::new();
        flate2::read::GzDecoder::new(std::fs::File::open(&path).expect("open"))
            .read_to_string(&mut s)
            .expect("gunzip");
        s
    };
    let mut right = 0;
    for (line, item) in text.lines().zip(&items) {
        let v: serde_json::Value = serde_json::from_str(line).expect("json");
        let chain = v["request"]["continuation"].as_str().expect("continuation");
        right += usize::from(gsm8k_correct(chain, &item.answer));
    }
    assert_eq!(right, 1_319);
}

#[test]
fn malformed_lines_name_the_file_and_line() {
    let dir = tempfile::tempdir().expect("tempdir");
    let arc = dir.path().join("arc.jsonl");
    let good = r#"{"doc_id": 0, "idx": 0, "native_id": "q0", "doc": {"choices": ["x", "y"], "gold": 1}, "request": {"context": "Q?", "continuation": " x"}}"#;
    let mut f = std::fs::File::create(&arc).expect("create");
    writeln!(f, "{good}\n{{\"doc_id\": 0, \"idx\": ").expect("write");
    drop(f);
    let err = read_mc(McTask::ArcChallenge, &arc, 10, Pick::First)
        .expect_err("broken line")
        .to_string();
    assert!(err.contains(&format!("{}:2:", arc.display())), "{err}");

    // A document with fewer lines than choices is an error at its first line.
    let err = read_mc(
        McTask::ArcChallenge,
        &{
            let p = dir.path().join("short.jsonl");
            std::fs::write(&p, format!("{good}\n")).expect("write");
            p
        },
        10,
        Pick::First,
    )
    .expect_err("one line for two choices")
    .to_string();
    assert!(
        err.contains("short.jsonl:1:") && err.contains("2 choices but 1"),
        "{err}"
    );

    let mmlu = dir.path().join("mmlu.jsonl");
    std::fs::write(
        &mmlu,
        concat!(
            r#"{"question": "question", "answer_a": "answer_a", "answer_b": "answer_b", "answer_c": "answer_c", "answer_d": "answer_d", "correct_answer": "answer", "topic": "t"}"#,
            "\n\n",
            r#"{"question": "Q", "answer_a": "a", "answer_b": "b", "answer_c": "c", "answer_d": "d", "correct_answer": "E", "topic": "t"}"#,
            "\n"
        ),
    )
    .expect("write");
    let err = read_mc(McTask::Mmlu, &mmlu, 10, Pick::First)
        .expect_err("bad letter")
        .to_string();
    assert!(
        err.contains("mmlu.jsonl:3:") && err.contains("\"E\""),
        "{err}"
    );

    let gsm = dir.path().join("gsm.jsonl");
    std::fs::write(
        &gsm,
        "{\"doc\": {\"id\": 0}, \"request\": {\"context\": \"q\"}}\n",
    )
    .expect("write");
    let err = read_gsm8k(&gsm, 10, Pick::First)
        .expect_err("no short_answer")
        .to_string();
    assert!(
        err.contains("gsm.jsonl:1:") && err.contains("short_answer"),
        "{err}"
    );
}

/// HumanEval from the zoo's file: 164 problems, and every canonical solution passes its own
/// tests when executed, while a body that returns nothing fails them.
#[test]
fn humaneval_canonical_solutions_pass_their_tests() {
    use switchyard_eval::quality::{load_humaneval, run_tests, Isolation, Outcome};
    let items = load_humaneval(usize::MAX, Pick::First).expect("humaneval");
    assert_eq!(items.len(), 164);
    assert_eq!(items[0].task_id, "HumanEval/0");
    assert_eq!(items[0].entry_point, "has_close_elements");
    assert!(items[0]
        .prompt
        .starts_with("from typing import List\n\n\ndef has_close_elements("));
    let iso = Isolation::detect();
    let failed: Vec<(String, Outcome)> = items
        .iter()
        .map(|it| {
            (
                it.task_id.clone(),
                run_tests(it, &it.canonical_solution, iso).expect("ran"),
            )
        })
        .filter(|(_, o)| !o.passed())
        .collect();
    assert!(failed.is_empty(), "{failed:?}");
    let empty = run_tests(&items[0], "    return None\n", iso).expect("ran");
    assert!(matches!(empty, Outcome::Failed(_)), "{empty:?}");
    let picked = load_humaneval(5, Pick::Seeded(7)).expect("picked");
    assert_eq!(picked, load_humaneval(5, Pick::Seeded(7)).expect("again"));
}
