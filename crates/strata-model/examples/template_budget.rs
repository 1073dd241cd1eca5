//! What the chat template budget costs and bounds (docs/BENCHMARKS.md, "Chat templates on a
//! budget"): for each template file given (llama.cpp's `models/templates/*.jinja`) and the
//! reference model's own, the template instructions of a 2- and a 200-message conversation
//! (found by bisecting the budget) and a render's time with and without instruction counting;
//! then how long a template that spends the whole budget holds a CPU.
//!
//! With `--sandbox STRATA` first, also a render's time in this process and through a child of
//! the `strata` program at that path ([`strata_model::template_sandbox`]), as `strata` renders.
//!
//! `cargo run --release -p strata-model --example template_budget -- [--sandbox target/release/strata] TEMPLATE.jinja ...`

use std::time::Instant;

use minijinja::{context, Environment};
use strata_model::chat::Message;
use strata_model::ChatTemplate;

fn conversation(n: usize) -> Vec<serde_json::Value> {
    (0..n)
        .map(|i| {
            let role = if i % 2 == 0 { "user" } else { "assistant" };
            serde_json::json!({"role": role, "content": "hello there, how are you today?"})
        })
        .collect()
}

fn render(env: &Environment, fuel: Option<u64>, msgs: &[serde_json::Value]) -> bool {
    let mut e = env.clone();
    e.set_fuel(fuel);
    let ctx = context! {messages => msgs, add_generation_prompt => true,
    bos_token => "<s>", eos_token => "</s>"};
    e.get_template("t").is_ok_and(|t| t.render(ctx).is_ok())
}

/// The fewest instructions that render `msgs` (None: it does not render at all).
fn instructions(env: &Environment, msgs: &[serde_json::Value]) -> Option<u64> {
    let (mut lo, mut hi) = (1u64, 1u64 << 34);
    if !render(env, Some(hi), msgs) {
        return None;
    }
    while lo < hi {
        let m = (lo + hi) / 2;
        if render(env, Some(m), msgs) {
            hi = m
        } else {
            lo = m + 1
        }
    }
    Some(lo)
}

/// The best of 5 runs of `reps` renders, in µs a render, without and with counting (None:
/// the template refuses this conversation).
fn timed(env: &Environment, msgs: &[serde_json::Value], reps: usize) -> Option<[f64; 2]> {
    let mut best = [f64::MAX; 2];
    for _ in 0..5 {
        for (k, fuel) in [None, Some(1 << 40)].into_iter().enumerate() {
            let t = Instant::now();
            for _ in 0..reps {
                if !render(env, fuel, msgs) {
                    return None;
                }
            }
            best[k] = best[k].min(t.elapsed().as_secs_f64() * 1e6 / reps as f64);
        }
    }
    Some(best)
}

fn main() {
    let model = strata_model::fetch::cache_dir().join(strata_model::fetch::MODEL_FILE);
    let mut sources = Vec::new();
    if let Ok(h) = strata_model::GgufHeader::open(&model) {
        if let Some(t) = h.string("tokenizer.chat_template") {
            sources.push(("SmolLM2 (the reference model)".to_string(), t.to_string()));
        }
    }
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().is_some_and(|a| a == "--sandbox") {
        let program = args.get(1).expect("--sandbox STRATA").clone();
        args.drain(..2);
        sandboxed(&sources, program.into());
    }
    for p in args {
        let src = std::fs::read_to_string(&p).expect("a template file");
        sources.push((p, src));
    }
    println!("template | instructions, 2 messages | per message | µs, 16 messages, uncounted | counted | µs, 4,096 messages, uncounted | counted");
    for (name, src) in sources {
        let mut env = Environment::new();
        env.add_function(
            "raise_exception",
            |m: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    m,
                ))
            },
        );
        env.add_function("strftime_now", |_f: String| "2026-12-07".to_string());
        if env.add_template_owned("t", src).is_err() {
            continue;
        }
        let (Some(a), Some(b)) = (
            instructions(&env, &conversation(2)),
            instructions(&env, &conversation(200)),
        ) else {
            continue;
        };
        let (Some(short), Some(long)) = (
            timed(&env, &conversation(16), 200),
            timed(&env, &conversation(4096), 3),
        ) else {
            continue;
        };
        println!(
            "{name} | {a} | {} | {:.1} | {:.1} | {:.0} | {:.0}",
            (b - a) / 198,
            short[0],
            short[1],
            long[0],
            long[1]
        );
    }
    let t = Instant::now();
    let nested = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}";
    let e = ChatTemplate::new(nested).err().expect("refused");
    println!(
        "a template looping 10^10 times, refused when opened in {:?}: {e}",
        t.elapsed()
    );
    let per = "{% for m in messages %}{% for i in range(100000) %}{% endfor %}{% endfor %}";
    let t = ChatTemplate::new(per).expect("short conversations render");
    let msgs = vec![Message::new("user", "x"); 120_000];
    let t0 = Instant::now();
    let e = t.render(&msgs, true).expect_err("refused");
    println!(
        "the same per message, 120,000 messages, refused in {:?}: {e}",
        t0.elapsed()
    );
}

/// A render's time (best of 5) in this process and through a child of `program`, for the
/// reference model's template: 16 and 4,096 messages.
fn sandboxed(sources: &[(String, String)], program: std::path::PathBuf) {
    let Some((_, src)) = sources.first() else {
        return;
    };
    let here = ChatTemplate::new(src).expect("the template");
    strata_model::template_sandbox::enable(program);
    let child = ChatTemplate::new(src).expect("the template, through a child");
    for (n, reps) in [(16usize, 200), (4096, 5)] {
        let msgs: Vec<Message> = (0..n)
            .map(|i| Message::new(if i % 2 == 0 { "user" } else { "assistant" }, "hello there"))
            .collect();
        let mut best = [f64::MAX; 2];
        for _ in 0..5 {
            for (k, t) in [&here, &child].into_iter().enumerate() {
                let t0 = Instant::now();
                for _ in 0..reps {
                    t.render(&msgs, true).expect("renders");
                }
                best[k] = best[k].min(t0.elapsed().as_secs_f64() * 1e6 / reps as f64);
            }
        }
        println!(
            "{n} messages: in this process {:.1} µs, through a child {:.1} µs",
            best[0], best[1]
        );
    }
}
