//! `disagg generate`: one prompt in, one completion out.

use clap::Args;
use engine::load::cpu_engine;
use engine::sampling::SamplingParams;
use engine::scheduler::run_to_completion;
use engine::tokenizer::ChatMessage;
use serde_json::json;

use crate::EngineArgs;

#[derive(Args, Debug)]
pub struct GenerateArgs {
    #[command(flatten)]
    engine: EngineArgs,
    /// The prompt text.
    #[arg(long, conflicts_with = "prompt_ids", required_unless_present = "prompt_ids")]
    prompt: Option<String>,
    /// The prompt as comma-separated token ids.
    #[arg(long, value_delimiter = ',')]
    prompt_ids: Option<Vec<u32>>,
    /// Wrap the prompt as a user message in the model's chat template.
    #[arg(long)]
    chat: bool,
    /// A system message (with --chat).
    #[arg(long, requires = "chat")]
    system: Option<String>,
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    #[arg(long, default_value_t = 0)]
    min_tokens: usize,
    /// 0 (the default) is greedy.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    temperature: f32,
    #[arg(long, default_value_t = 0, allow_negative_numbers = true)]
    top_k: i32,
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    top_p: f32,
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    min_p: f32,
    #[arg(long)]
    seed: Option<u64>,
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    repetition_penalty: f32,
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    presence_penalty: f32,
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    frequency_penalty: f32,
    /// Stop string (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    /// Stop token ids, comma-separated.
    #[arg(long, value_delimiter = ',')]
    stop_token_ids: Vec<u32>,
    /// Keep going past end-of-sequence tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// Report the chosen token's logprob and this many top alternatives per position.
    #[arg(long)]
    logprobs: Option<usize>,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
    /// Also write the logits at the prompt's last position to this file (vocab × f32,
    /// little-endian), for comparison with a reference implementation
    /// (`tools/random_reference.py`).
    #[arg(long)]
    logits_out: Option<std::path::PathBuf>,
}

pub fn run(a: GenerateArgs) -> anyhow::Result<()> {
    let opts = a.engine.options()?;
    let params = SamplingParams {
        max_tokens: Some(a.max_tokens),
        min_tokens: a.min_tokens,
        temperature: a.temperature,
        top_k: a.top_k,
        top_p: a.top_p,
        min_p: a.min_p,
        seed: a.seed,
        repetition_penalty: a.repetition_penalty,
        presence_penalty: a.presence_penalty,
        frequency_penalty: a.frequency_penalty,
        stop: a.stop.clone(),
        stop_token_ids: a.stop_token_ids.clone(),
        ignore_eos: a.ignore_eos,
        logprobs: a.logprobs,
        logit_bias: Vec::new(),
        skip_special_tokens: true,
        cache_salt: None,
    };
    match opts.device {
        engine::load::Device::Cpu => generate_on(a, params, cpu_engine(&opts)?),
        engine::load::Device::Cuda(_) => generate_on(a, params, engine::load::cuda_engine(&opts)?),
    }
}

fn generate_on<B: kernels::Backend>(
    a: GenerateArgs,
    params: SamplingParams,
    mut core: engine::scheduler::EngineCore<B>,
) -> anyhow::Result<()> {
    params.validate(core.model.cfg.vocab).map_err(|e| anyhow::anyhow!("{e} (check the sampling flags)"))?;
    let tok = core.tokenizer.clone();
    let prompt_ids = match (&a.prompt, &a.prompt_ids) {
        (_, Some(ids)) => ids.clone(),
        (Some(text), None) if a.chat => {
            let mut messages = Vec::new();
            if let Some(s) = &a.system {
                messages.push(ChatMessage { role: "system".into(), content: s.clone() });
            }
            messages.push(ChatMessage { role: "user".into(), content: text.clone() });
            tok.encode(&tok.apply_chat_template(&messages, true)?)?
        }
        (Some(text), None) => tok.encode_prompt(text)?,
        (None, None) => anyhow::bail!("give --prompt TEXT or --prompt-ids 1,2,3"),
    };
    if let Some(path) = &a.logits_out {
        let logits = core.score(&prompt_ids)?;
        let bytes: Vec<u8> = logits.iter().flat_map(|x| x.to_le_bytes()).collect();
        std::fs::write(path, bytes).map_err(|e| anyhow::anyhow!("--logits-out {}: {e}", path.display()))?;
    }
    let done = run_to_completion(&mut core, vec![(prompt_ids.clone(), params)], 0)?.remove(0);
    if a.json {
        let mut out = json!({
            "model": core.model.cfg.name,
            "prompt_ids": prompt_ids,
            "output_ids": done.output_ids,
            "text": done.text,
            "finish_reason": done.finish.as_ref().map(|f| f.as_str()),
            "prompt_tokens": done.prompt_tokens,
            "completion_tokens": done.output_ids.len(),
        });
        if a.logprobs.is_some() {
            out["logprobs"] = done
                .logprobs
                .iter()
                .map(|l| {
                    json!({
                        "token_id": l.token,
                        "token": tok.id_to_token(l.token),
                        "logprob": l.logprob,
                        "top_logprobs": l.top.iter().map(|(t, lp)| json!({"token_id": t, "token": tok.id_to_token(*t), "logprob": lp})).collect::<Vec<_>>(),
                    })
                })
                .collect();
        }
        println!("{}", serde_json::to_string(&out)?);
    } else {
        println!("{}", done.text);
    }
    Ok(())
}
