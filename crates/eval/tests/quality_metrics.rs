//! The quality matrix's pure measures through the public API: ROUGE-L on hand-computed pairs,
//! the Wilson and paired intervals against closed-form values, GSM8K answer extraction.

use switchyard_eval::quality::{
    extract_answer, gsm8k_correct, paired_diff95, rouge_l, rouge_l_score, score_gen, wilson95,
    GenItem, GSM8K_STOP,
};

#[test]
fn rouge_l_on_hand_computed_pairs() {
    assert_eq!(
        rouge_l("the cat sat on the mat", "the cat sat on the mat"),
        1.0
    );
    // Case and punctuation do not count: the tokens are the same.
    assert_eq!(
        rouge_l("The cat, sat on THE mat!", "the cat sat on the mat"),
        1.0
    );
    // Candidate 5 tokens, reference 6, LCS 5: P = 1, R = 5/6, F = 10/11.
    let s = rouge_l_score("the cat on the mat", "the cat sat on the mat");
    assert_eq!(s.precision, 1.0);
    assert!((s.recall - 5.0 / 6.0).abs() < 1e-15);
    assert!((s.fmeasure - 10.0 / 11.0).abs() < 1e-15, "{}", s.fmeasure);
    // Symmetric in F with P and R swapped.
    assert!((rouge_l("the cat sat on the mat", "the cat on the mat") - 10.0 / 11.0).abs() < 1e-15);
    // LCS is a subsequence, not a substring: "a b c d" vs "a x c y d" share a c d (3):
    // P = 3/4, R = 3/5, F = 2/3.
    assert!((rouge_l("a b c d", "a x c y d") - 2.0 / 3.0).abs() < 1e-15);
    // Word order matters: reversed 3 tokens keep an LCS of 1: F = 1/3.
    assert!((rouge_l("one two three", "three two one") - 1.0 / 3.0).abs() < 1e-15);
    assert_eq!(rouge_l("", "the cat"), 0.0);
    assert_eq!(rouge_l("the cat", ""), 0.0);
    assert_eq!(rouge_l("...", "!!!"), 0.0);
    assert_eq!(rouge_l("dog", "cat"), 0.0);
}

#[test]
fn wilson_interval_to_four_decimals() {
    let round4 = |x: f64| (x * 1e4).round() / 1e4;
    let (lo, hi) = wilson95(50, 100);
    assert_eq!((round4(lo), round4(hi)), (0.4038, 0.5962));
    let (lo, hi) = wilson95(0, 10);
    assert_eq!((round4(lo), round4(hi)), (0.0, 0.2775));
    let (lo, hi) = wilson95(10, 10);
    assert_eq!((round4(lo), round4(hi)), (0.7225, 1.0));
}

#[test]
fn paired_difference_on_a_fixed_example() {
    let a = [
        true, true, false, true, false, true, true, false, true, true,
    ];
    let b = [
        true, false, false, true, true, false, true, false, false, true,
    ];
    // Per-item differences 0,1,0,0,-1,1,0,0,1,0: mean 0.2, sample s = sqrt(0.4) = 0.63246,
    // se = 0.2, half width 1.96 * 0.2 = 0.39199: (20.0, -19.1993, 59.1993) points.
    let (m, lo, hi) = paired_diff95(&a, &b);
    assert!((m - 20.0).abs() < 1e-12);
    assert!((lo + 19.1993).abs() < 1e-4, "{lo}");
    assert!((hi - 59.1993).abs() < 1e-4, "{hi}");
    let (m, lo, hi) = paired_diff95(&b, &a);
    assert!((m + 20.0).abs() < 1e-12 && (lo + 59.1993).abs() < 1e-4 && (hi - 19.1993).abs() < 1e-4);
}

#[test]
fn gsm8k_answer_extraction() {
    let cases = [
        (
            " Janet sells 16 - 3 - 4 = 9 duck eggs a day. She makes 9 * 2 = $18 every day at \
          the farmer's market. So the answer is 18.",
            Some("18"),
        ),
        ("So the answer is 1,234.", Some("1234")),
        ("THE ANSWER IS $5", Some("5")),
        ("So the answer is: -7.", Some("-7")),
        ("The answer is 3.5 hours. Later 9", Some("3.5")),
        ("so 4 + 4 = 8\n#### 8", Some("8")),
        ("She has 12 apples and eats 2, leaving 10.", Some("10")),
        ("Total: 1,000,000.", Some("1000000")),
        ("no number", None),
    ];
    for (text, want) in cases {
        assert_eq!(extract_answer(text).as_deref(), want, "{text:?}");
    }
    assert!(gsm8k_correct("So the answer is 18.", "18"));
    assert!(gsm8k_correct("So the answer is 18.00", "18"));
    assert!(gsm8k_correct("So the answer is 70,000.", "70000"));
    assert!(!gsm8k_correct("So the answer is 17.", "18"));
    // "the answer is" outranks a later number.
    assert!(gsm8k_correct("So the answer is 6. Question 7", "6"));
    assert_eq!(GSM8K_STOP, ["Question:", "</s>", "<|im_end|>", "\n\n"]);

    let item = |answer: &str| GenItem {
        id: "x".into(),
        prompt: String::new(),
        answer: answer.into(),
    };
    let s = score_gen(&[
        (item("18"), "So the answer is 18.".into()),
        (item("5"), "So the answer is 6.".into()),
        (item("7"), "7".into()),
    ]);
    assert_eq!((s.n, s.correct), (3, 2));
    assert_eq!(s.per_item, [true, false, true]);
    assert!((s.accuracy - 2.0 / 3.0).abs() < 1e-15);
    assert_eq!(s.ci95, wilson95(2, 3));
}
