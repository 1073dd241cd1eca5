//! Sizing flags shared by every command that allocates cache memory (`strata plan`, and the
//! servers later): model pools, device and host budgets, NUMA placement.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{ArgGroup, Args};
use strata_kv::dtype::Dtype;
use strata_kv::units::parse_size;
use strata_mem::{
    preset, DeviceBudget, HostBudget, KindSpec, ModelSpec, NumaChoice, NumaPolicy, PlanRequest,
    Scratch, Topology, PRESETS,
};
use strata_model::scratch::{CallLimits, ModelShape};

/// What a server does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Role {
    Prefill,
    Decode,
    Both,
    Server,
}

impl Role {
    /// Whether this role receives K/V from prefill workers (and listens for it).
    pub fn receives_kv(&self) -> bool {
        matches!(self, Role::Decode | Role::Both)
    }

    pub fn name(&self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Both => "both",
            Role::Server => "server",
        }
    }
}

/// The device pool per rank when no device flag is given.
const DEFAULT_DEVICE_MEM: &str = "1GiB";
/// Most `--threads`.
pub const MAX_THREADS: usize = 1024;

/// `--model-preset`'s help, from the table the planner uses (every preset it knows).
fn preset_help() -> String {
    format!(
        "Built-in model whose pool kinds are sized: {} (docs/SIZING.md: deepseek-v3.2 is the \
         incident's MLA latent and indexer pools as its operators wrote them; deepseek-v4-* \
         DeepSeek-V4's seven state kinds)",
        preset_names()
    )
}

/// Every preset the planner knows, comma-separated (help texts).
pub(crate) fn preset_names() -> String {
    strata_mem::PRESETS.join(", ")
}

/// How the K/V pools store their values (the llama family's; other models' state kinds keep
/// the dtypes the model defines).
#[derive(Args, Debug, Clone)]
pub struct KvDtypeArgs {
    /// Element type of the K and V pools: f16, q8_0 (ggml's blocks of 32 values: 34 bytes,
    /// 1.88× the tokens of f16 in every tier) or fp8_e4m3 (a byte a value).
    #[arg(long, default_value = "f16", value_parser = kv_dtype, help_heading = "K/V dtype")]
    pub kv_cache_dtype: Dtype,
    /// K alone (as llama.cpp's -ctk); default: --kv-cache-dtype.
    #[arg(long, value_parser = kv_dtype, help_heading = "K/V dtype")]
    pub cache_type_k: Option<Dtype>,
    /// V alone (as llama.cpp's -ctv); default: --kv-cache-dtype.
    #[arg(long, value_parser = kv_dtype, help_heading = "K/V dtype")]
    pub cache_type_v: Option<Dtype>,
}

/// A K/V dtype flag's value (one of [`Dtype::KV`]).
pub fn kv_dtype(s: &str) -> Result<Dtype, String> {
    Dtype::parse_kv(s).ok_or_else(|| {
        let known: Vec<&str> = Dtype::KV.iter().map(|d| d.name()).collect();
        format!("`{s}`: expected one of {}", known.join(", "))
    })
}

impl KvDtypeArgs {
    /// The K and V dtypes asked for.
    pub fn kv(&self) -> (Dtype, Dtype) {
        (
            self.cache_type_k.unwrap_or(self.kv_cache_dtype),
            self.cache_type_v.unwrap_or(self.kv_cache_dtype),
        )
    }

    /// `model` with its K/V pools in those dtypes, or why they do not apply to it.
    pub fn apply(&self, model: ModelSpec) -> Result<ModelSpec> {
        let (k, v) = self.kv();
        model
            .with_kv_dtypes(k, v)
            .map_err(|why| anyhow::anyhow!("--kv-cache-dtype {k} (K) / {v} (V): {why}"))
    }
}

#[derive(Args, Debug, Clone)]
#[command(group(ArgGroup::new("host_budget").args(["hicache_size", "hicache_total", "hicache_ratio"]).multiple(false)))]
#[command(group(ArgGroup::new("device_budget").args(["device_mem", "device_mem_fraction"]).multiple(false)))]
pub struct SizingArgs {
    #[arg(
        long,
        default_value = "smollm2-135m",
        conflicts_with = "model",
        help_heading = "Model",
        help = preset_help()
    )]
    pub model_preset: String,
    /// A GGUF file: its pool kinds (f16 K/V per layer, KV heads split over TP ranks) are sized.
    #[arg(long, help_heading = "Model")]
    pub model: Option<PathBuf>,
    /// Tensor-parallel ranks of this server.
    #[arg(long, default_value_t = 1, help_heading = "Model")]
    pub tp_size: u32,
    /// Tokens per KV page.
    #[arg(long, default_value_t = 16, help_heading = "Model")]
    pub page_size: usize,
    /// What this server does: prefill, decode, both (PD roles; decode and both listen for K/V)
    /// or server (one worker, no PD). Also a label in reports.
    #[arg(long, value_enum, default_value_t = Role::Server, help_heading = "Model")]
    pub role: Role,
    #[command(flatten)]
    pub kv_dtype: KvDtypeArgs,

    /// Device KV pool per rank, with a unit: `8GiB` (2^30) or `8GB` (10^9).
    #[arg(long, help_heading = "Device pool (one of)")]
    pub device_mem: Option<String>,
    /// Device KV pool per rank as a fraction of the free device memory (default 1GiB absolute).
    #[arg(long, help_heading = "Device pool (one of)")]
    pub device_mem_fraction: Option<f64>,

    /// Host (L2) cache bytes PER RANK, with a unit (`37.5GB`).
    #[arg(long, help_heading = "Host cache (one of)")]
    pub hicache_size: Option<String>,
    /// Host (L2) cache bytes for the WHOLE SERVER, split evenly over its ranks (`150GB`).
    #[arg(long, help_heading = "Host cache (one of)")]
    pub hicache_total: Option<String>,
    /// Host tokens = R × device tokens. Small on prefill servers: prefer a size.
    #[arg(
        long,
        allow_negative_numbers = true,
        help_heading = "Host cache (one of)"
    )]
    pub hicache_ratio: Option<f64>,

    /// Models with window kinds (DeepSeek-V4's sliding-window K/V and compressor rows, read
    /// only for the last tokens before a continuation): window pages per page in each tier,
    /// in (0, 1]. Below 1 the budgets hold more tokens; a prefix whose window pages were
    /// dropped resumes from the deepest boundary that kept them. Default 1.
    #[arg(long, help_heading = "Pools", allow_negative_numbers = true)]
    pub window_tokens_ratio: Option<f64>,
    /// Models with window kinds (DeepSeek-V4): a committed prefix keeps its window state at
    /// its end, where it left the cached prefixes, and at a checkpoint every this many pages
    /// (a hit between checkpoints resumes from the one before it). Default: derived by the
    /// plan from the host budget; 0: every page keeps its own (and a running request holds
    /// one per page it computes).
    #[arg(long, help_heading = "Pools")]
    pub window_checkpoint_pages: Option<u64>,

    /// Tokens per model call (decode tokens first, then prefill chunks).
    #[arg(long, default_value_t = 512, help_heading = "Scheduling")]
    pub max_batch_tokens: usize,
    /// Requests computing at once (with window kinds, the plan keeps a window ring for each).
    #[arg(long, default_value_t = 32, help_heading = "Scheduling")]
    pub max_running: usize,
    /// Threads for matrix products and attention (split evenly over --tp-size ranks); the
    /// plan counts the forward pass's scratch for them.
    #[arg(long, default_value_t = 2, help_heading = "Scheduling")]
    pub threads: usize,

    /// Conversations kept for /v1/responses' previous_response_id: at most this many bytes
    /// (their JSON), with a unit; the oldest go first. The plan reserves it.
    #[arg(long, default_value = "64MiB", help_heading = "Responses API")]
    pub response_store_size: String,
    /// Received K/V held at most before transfers are told to retry, with a unit. The plan of
    /// a worker that receives K/V (decode, both) reserves it.
    #[arg(long, default_value = "1GiB", help_heading = "PD disaggregation")]
    pub kv_staging: String,

    /// NUMA node for the host cache: a number, or `auto` (the node of the CPUs this process may
    /// use, else the one with the most available memory).
    #[arg(long, default_value = "auto", help_heading = "NUMA")]
    pub numa_node: String,
    /// NUMA node of each tensor-parallel rank, comma-separated (one per rank, or one for all):
    /// each rank's pools (host and device) are bound there, and `strata serve` pins the
    /// rank's threads to the node's CPUs (ranks sharing a node split them) and first-touches
    /// its weights there. Each node must hold its ranks' pools.
    #[arg(
        long,
        value_delimiter = ',',
        conflicts_with = "numa_node",
        help_heading = "NUMA"
    )]
    pub numa_nodes: Vec<u32>,
    /// bind (only that node), interleave (all nodes), preferred (that node, spill elsewhere).
    #[arg(long, default_value = "bind", help_heading = "NUMA")]
    pub numa_policy: String,
    /// Memory left to the OS and everything else on the node (default: 10 % of the node, at
    /// most 10GiB).
    #[arg(long, help_heading = "NUMA")]
    pub host_mem_reserve: Option<String>,
    /// Back host pools with transparent huge pages.
    #[arg(long, help_heading = "NUMA")]
    pub huge_pages: bool,
    /// Plan for another machine instead of this one: `2x240GB` (two NUMA nodes of 240 GB
    /// each) or the nodes' sizes in order, `240GB,256GB`.
    #[arg(long, conflicts_with = "sysfs_root", help_heading = "NUMA")]
    pub machine: Option<String>,
    /// Read the NUMA topology from this sysfs root instead of /sys (tests, what-if plans).
    #[arg(long, hide = true)]
    pub sysfs_root: Option<PathBuf>,
    /// System meminfo to use with --sysfs-root.
    #[arg(long, hide = true)]
    pub proc_meminfo: Option<PathBuf>,
}

fn size(flag: &str, v: &str) -> Result<u64> {
    parse_size(v).with_context(|| format!("--{flag}"))
}

/// A machine described on the command line: `NxSIZE` or `SIZE,SIZE,...` (one per NUMA node).
/// Its nodes' memory is all available (the plan's reserve still applies).
pub fn what_if(spec: &str) -> Result<Topology> {
    let sizes: Vec<(String, u64)> = match spec.split_once(['x', 'X']) {
        Some((n, size)) if n.chars().all(|c| c.is_ascii_digit()) && !n.is_empty() => {
            let n: usize = n.parse().with_context(|| format!("--machine `{spec}`"))?;
            if n == 0 || n > 64 {
                bail!("--machine `{spec}`: 1 to 64 NUMA nodes");
            }
            let b = size_of_machine(spec, size)?;
            (0..n).map(|_| (size.trim().to_string(), b)).collect()
        }
        _ => spec
            .split(',')
            .map(|p| Ok((p.trim().to_string(), size_of_machine(spec, p)?)))
            .collect::<Result<_>>()?,
    };
    Ok(Topology {
        nodes: sizes
            .into_iter()
            .enumerate()
            .map(|(i, (text, b))| strata_mem::Node {
                id: i as u32,
                cpus: Vec::new(),
                total_bytes: b,
                available_bytes: b,
                source: format!("--machine {spec}: node {i} of {text}, all of it available"),
            })
            .collect(),
    })
}

fn size_of_machine(spec: &str, part: &str) -> Result<u64> {
    let b = parse_size(part).with_context(|| format!("--machine `{spec}`"))?;
    if b == 0 {
        bail!("--machine `{spec}`: a node of 0 bytes");
    }
    Ok(b)
}

/// Pre-fault progress on stderr for host pools of at least `min_bytes`: percent, GiB done and
/// GiB/s, redrawn on one line on a terminal, else a line per quarter (a log file reads it).
/// A stderr that cannot be written (closed) loses the progress, nothing else.
pub fn prefault_progress(label: String, min_bytes: u64) -> strata_mem::numa::Progress {
    use std::io::IsTerminal;
    let start = std::time::Instant::now();
    let terminal = std::io::stderr().is_terminal();
    let last_quarter = std::sync::Mutex::new(None::<u64>);
    std::sync::Arc::new(move |done: u64, total: u64| {
        use std::io::Write;
        if total < min_bytes {
            return;
        }
        let pct = done * 100 / total.max(1);
        if !terminal {
            let mut last = last_quarter.lock().unwrap_or_else(|e| e.into_inner());
            if *last == Some(pct / 25) {
                return;
            }
            *last = Some(pct / 25);
        }
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        let secs = start.elapsed().as_secs_f64().max(1e-9);
        let line = format!(
            "pre-faulting {label}: {pct:>3}% ({:.2} of {:.2} GiB, {:.2} GiB/s)",
            gib(done),
            gib(total),
            gib(done) / secs
        );
        let mut err = std::io::stderr().lock();
        let _ = if !terminal {
            writeln!(err, "{line}")
        } else if done == total {
            writeln!(err, "\r{line}")
        } else {
            write!(err, "\r{line}")
        };
        let _ = err.flush();
    })
}

/// CPUs this process may run on.
pub(crate) fn allowed_cpus() -> Vec<u32> {
    // SAFETY: cpu_set_t is plain data; sched_getaffinity fills it for the calling thread.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: pid 0 = this thread; size and pointer describe `set`.
    let rc =
        unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    if rc != 0 {
        return Vec::new();
    }
    // SAFETY: CPU_ISSET reads the set filled above, for indices below CPU_SETSIZE.
    (0..libc::CPU_SETSIZE as usize)
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .map(|c| c as u32)
        .collect()
}

/// The pools a GGUF file's model declares, from its header: for llama, f16 K/V per layer with
/// the KV heads split over TP ranks; for DeepSeek-V4, every state kind in f32, as the engine
/// keeps them.
pub fn model_spec_of(path: &std::path::Path) -> Result<ModelSpec> {
    Ok(model_file(path)?.0)
}

/// A model file's pools (as [`model_spec_of`] says) and its hyper-parameters, from one read of
/// its header.
fn model_file(path: &std::path::Path) -> Result<(ModelSpec, ModelShape)> {
    let name = path
        .file_name()
        .map(|f| f.to_string_lossy().into_owned())
        .unwrap_or_default();
    let shape = ModelShape::read(path)?;
    // The weights, in host memory beside the pools: the file's bytes (its tensors, and a
    // header of a few MiB at most).
    let weights_bytes = std::fs::metadata(path)
        .with_context(|| format!("--model {}", path.display()))?
        .len();
    let kinds = match &shape {
        ModelShape::Dsv4(c) => {
            let count = |r| c.ratios.iter().filter(|&&x| x == r).count();
            strata_mem::dsv4_kinds(&strata_mem::Dsv4Shape {
                layers: c.ratios.len(),
                csa_layers: count(4),
                hca_layers: count(128),
                head_dim: c.head_dim,
                indexer_dim: c.indexer_dim,
                window: c.window,
                cache_dtype: strata_kv::dtype::Dtype::F32,
                state_dtype: strata_kv::dtype::Dtype::F32,
            })
        }
        ModelShape::Llama(c) => vec![KindSpec {
            name: "kv".into(),
            layers: c.layers,
            planes: 2,
            heads: c.kv_heads,
            head_dim: c.head_dim,
            dtype: strata_kv::dtype::Dtype::F16,
            split_across_tp: true,
            per: strata_mem::Per::Token,
            needed: strata_mem::Needed::Prefix,
        }],
    };
    let spec = ModelSpec {
        name,
        kinds,
        weights_bytes,
    };
    Ok((spec, shape))
}

impl SizingArgs {
    pub fn topology(&self) -> Result<Topology> {
        if let Some(m) = &self.machine {
            return what_if(m);
        }
        Ok(match &self.sysfs_root {
            Some(root) => {
                let proc = self
                    .proc_meminfo
                    .clone()
                    .unwrap_or_else(|| root.join("proc-meminfo"));
                Topology::from_root(root, &proc)?
            }
            None => Topology::detect()?,
        })
    }

    /// The pools of `--model` (read from the GGUF, with its hyper-parameters) or of
    /// `--model-preset` (none), K/V in the dtypes asked for.
    fn model_spec(&self) -> Result<(ModelSpec, Option<ModelShape>)> {
        let (model, shape) = self.model_spec_f16()?;
        Ok((self.kv_dtype.apply(model)?, shape))
    }

    fn model_spec_f16(&self) -> Result<(ModelSpec, Option<ModelShape>)> {
        if let Some(path) = &self.model {
            let (spec, shape) = model_file(path)?;
            return Ok((spec, Some(shape)));
        }
        Ok((
            preset(&self.model_preset).with_context(|| {
                let renamed = match self.model_preset.as_str() {
                    "dsv4-like" => " (`dsv4-like` was DeepSeek-V3.2's shape: now `deepseek-v3.2`; DeepSeek-V4 is `deepseek-v4-pro` / `deepseek-v4-flash`)",
                    _ => "",
                };
                format!(
                    "--model-preset `{}`: unknown (known: {}){renamed}",
                    self.model_preset,
                    PRESETS.join(", ")
                )
            })?,
            None,
        ))
    }

    /// What the server may hold beside its pools and weights, by flag (the plan reserves it):
    /// the response store, and on a worker that receives K/V its staging.
    pub fn beside(&self) -> Result<Vec<(String, u64)>> {
        let store = size("response-store-size", &self.response_store_size)?;
        let mut beside = vec![("--response-store-size".to_string(), store)];
        if self.role.receives_kv() {
            let staging = size("kv-staging", &self.kv_staging)?;
            beside.push(("--kv-staging".to_string(), staging));
        }
        Ok(beside)
    }

    /// Parses and checks every flag; nothing is allocated.
    pub fn request(&self) -> Result<PlanRequest> {
        let (model, shape) = self.model_spec()?;
        // The ranks must split the model as loading it would (else the plan "fits" what the
        // worker then refuses): from the header read once for the pools.
        if let Some(shape) = &shape {
            shape.check_tp_split(self.tp_size as usize)?;
        }
        let device = match (&self.device_mem, self.device_mem_fraction) {
            (Some(s), _) => DeviceBudget::Bytes(size("device-mem", s)?),
            (None, Some(f)) => DeviceBudget::FractionOfFree(f),
            (None, None) => DeviceBudget::Bytes(size("device-mem", DEFAULT_DEVICE_MEM)?),
        };
        let host = match (&self.hicache_size, &self.hicache_total, self.hicache_ratio) {
            (Some(s), _, _) => Some(HostBudget::PerRank(size("hicache-size", s)?)),
            (_, Some(s), _) => Some(HostBudget::Total(size("hicache-total", s)?)),
            (_, _, Some(r)) => Some(HostBudget::Ratio(r)),
            _ => None,
        };
        let numa = self.numa_choice()?;
        let Some(policy) = NumaPolicy::parse(&self.numa_policy) else {
            bail!(
                "--numa-policy `{}`: expected bind, interleave or preferred",
                self.numa_policy
            );
        };
        let reserve = self
            .host_mem_reserve
            .as_deref()
            .map(|s| size("host-mem-reserve", s))
            .transpose()?;
        Ok(PlanRequest {
            role: self.role.name().to_string(),
            model,
            tp: self.tp_size,
            page_size: self.page_size,
            device,
            host,
            numa,
            policy,
            reserve,
            // This build computes on the CPU: its device pool is host memory on the same node.
            device_in_host_memory: true,
            // A what-if machine: none of this machine's CPUs say anything about its nodes.
            allowed_cpus: if self.machine.is_some() {
                Vec::new()
            } else {
                allowed_cpus()
            },
            host_text: self
                .hicache_size
                .clone()
                .or_else(|| self.hicache_total.clone()),
            // The default is echoed as it would be typed.
            device_text: self.device_mem.clone().or_else(|| {
                self.device_mem_fraction
                    .is_none()
                    .then(|| DEFAULT_DEVICE_MEM.to_string())
            }),
            device_default: self.device_mem.is_none() && self.device_mem_fraction.is_none(),
            window_ratio: self.window_tokens_ratio,
            window_checkpoint_pages: self.window_checkpoint_pages,
            max_running: self.max_running as u64,
            max_batch_tokens: self.max_batch_tokens as u64,
            beside: self.beside()?,
            scratch: self.scratch(shape.as_ref())?,
        })
    }

    /// `--numa-nodes` (one node for every rank, or one per rank), else `--numa-node`.
    fn numa_choice(&self) -> Result<NumaChoice> {
        if !self.numa_nodes.is_empty() {
            let n = &self.numa_nodes;
            return Ok(NumaChoice::Ranks(if n.len() == 1 {
                vec![n[0]; self.tp_size as usize]
            } else {
                n.clone()
            }));
        }
        Ok(match self.numa_node.as_str() {
            "auto" => NumaChoice::Auto,
            n => {
                NumaChoice::Node(n.parse().with_context(|| {
                    format!("--numa-node `{n}`: expected a node number or `auto`")
                })?)
            }
        })
    }

    /// What the forward calls of the model file's `shape` allocate under the batch limits and
    /// `--threads` (nothing for a preset, whose runtime is not this one).
    fn scratch(&self, shape: Option<&ModelShape>) -> Result<Scratch> {
        if !(1..=MAX_THREADS).contains(&self.threads) {
            bail!("--threads {}: expected 1 to {MAX_THREADS}", self.threads);
        }
        let Some(shape) = shape else {
            return Ok(Scratch::default());
        };
        let limits = CallLimits {
            tokens: self.max_batch_tokens as u64,
            sequences: self.max_running as u64,
            all_logit_rows: strata_engine::PROMPT_LOGPROB_ROWS as u64,
            threads: self.threads as u64,
        };
        Ok(shape.scratch(u64::from(self.tp_size), limits))
    }
}
