//! `switchyard generate`: one prompt, text streamed to stdout, speed to stderr.

use std::io::Write;

use clap::Args;
use switchyard_models::LoadOptions;
use switchyard_request::SamplingParams;
use switchyard_tokenizer::ChatMessage;

use crate::load::load_model;

#[derive(Args)]
pub struct GenerateArgs {
    /// Model name (see `switchyard models list`) or path to a GGUF file or model folder.
    #[arg(long, default_value = switchyard_zoo::DEFAULT_MODEL)]
    model: String,
    #[arg(long)]
    prompt: String,
    /// Wrap the prompt as a user turn in the model's chat template.
    #[arg(long)]
    chat: bool,
    /// System message for --chat.
    #[arg(long, requires = "chat")]
    system: Option<String>,
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
    /// 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// 0 is off.
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    #[arg(long, default_value_t = 1.0)]
    repetition_penalty: f32,
    #[arg(long)]
    seed: Option<u64>,
    /// Stop before this text (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    /// Keep generating past end-of-generation tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// OpenAI's presence penalty (-2 to 2) on tokens already generated.
    #[arg(long, default_value_t = 0.0, allow_hyphen_values = true)]
    presence_penalty: f32,
    /// OpenAI's frequency penalty (-2 to 2), per occurrence in the output.
    #[arg(long, default_value_t = 0.0, allow_hyphen_values = true)]
    frequency_penalty: f32,
    /// Drop tokens below this share of the most likely one's probability (0 is off).
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    /// End-of-generation tokens are banned until this many tokens exist.
    #[arg(long, default_value_t = 0)]
    min_tokens: usize,
    #[command(flatten)]
    early_exit: crate::exits::EarlyExitArgs,
}

pub fn run(a: GenerateArgs) -> anyhow::Result<()> {
    let params = SamplingParams {
        max_tokens: a.max_tokens,
        temperature: a.temperature,
        top_k: a.top_k,
        top_p: a.top_p,
        repetition_penalty: a.repetition_penalty,
        seed: a.seed,
        stop: a.stop,
        ignore_eos: a.ignore_eos,
        presence_penalty: a.presence_penalty,
        frequency_penalty: a.frequency_penalty,
        min_p: a.min_p,
        min_tokens: a.min_tokens,
        ..SamplingParams::default()
    };
    params.validate()?;
    let loaded = load_model(&a.model, &LoadOptions::default())?;
    let tok = &loaded.tokenizer;
    let prompt = if a.chat {
        let mut msgs = Vec::new();
        if let Some(s) = a.system {
            msgs.push(ChatMessage::new("system", s));
        }
        msgs.push(ChatMessage::new("user", a.prompt));
        let text = tok.apply_chat_template(&msgs, true)?;
        // Templates that write the BOS token themselves must not get a second one.
        let has_bos = tok
            .bos_id()
            .and_then(|b| tok.id_to_piece(b))
            .is_some_and(|b| text.starts_with(&b));
        tok.encode(&text, !has_bos, true)?
    } else {
        tok.encode(&a.prompt, true, false)?
    };
    if a.early_exit.enabled() {
        return crate::exits::generate(&a.model, &loaded, &prompt, &params, &a.early_exit);
    }
    let mut stdout = std::io::stdout().lock();
    let g = switchyard_engine::generate(&loaded.model, tok, &prompt, &params, |t| {
        // A closed pipe (e.g. `| head`) ends output, not the process.
        let _ = stdout.write_all(t.as_bytes());
        let _ = stdout.flush();
    })?;
    let _ = writeln!(stdout);
    eprintln!(
        "prompt: {} tokens, {:.1} tokens/s | decode: {} tokens, {:.1} tokens/s | finish: {:?}",
        g.prompt_tokens,
        g.timing.prompt_tokens_per_s(g.prompt_tokens),
        g.tokens.len(),
        g.timing.decode_tokens_per_s(g.tokens.len()),
        g.finish_reason
    );
    Ok(())
}
