//! A DeepSeek-V4 model's hyper-parameters, and the tensors they imply with their shapes:
//! what a file must hold (`Dsv4::new` checks it).

/// A tensor: shape as llama.cpp states it (`ne`, fastest first) and its values.
pub type Weights = std::collections::HashMap<String, (Vec<usize>, Vec<f32>)>;

/// The hyper-parameters the forward pass needs.
#[derive(Clone, Debug)]
pub struct Dsv4Config {
    pub embd: usize,
    pub vocab: usize,
    /// Tokens a sequence may hold (`deepseek4.context_length`).
    pub context: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub rope_dims: usize,
    pub q_lora_rank: usize,
    pub window: usize,
    pub ratios: Vec<usize>,
    pub experts: usize,
    pub experts_used: usize,
    pub expert_ffn: usize,
    pub hash_layers: usize,
    pub indexer_heads: usize,
    pub indexer_dim: usize,
    pub indexer_top_k: usize,
    pub out_groups: usize,
    pub out_lora_rank: usize,
    pub hc: usize,
    pub sinkhorn_iters: usize,
    pub eps_rms: f32,
    pub eps_hc: f32,
    pub rope_base: f32,
    pub compress_rope_base: f32,
    /// Per layer (the shared expert's too).
    pub swiglu_clamp: Vec<f32>,
    pub expert_weights_scale: f32,
    /// The chosen experts' weights are normalised to sum 1 before the scale.
    pub expert_weights_norm: bool,
}

/// Most blocks of a model (DeepSeek-V4-Pro has 61); bounds every per-layer list before it is
/// allocated.
pub const MAX_LAYERS: usize = 4096;

impl Dsv4Config {
    /// Checks the hyper-parameters before anything is sized or allocated from them: every
    /// dimension positive and bounded (so every product below stays far from overflow),
    /// ratios 0, 4 or 128, consistent divisions. The error names what is wrong.
    pub fn validate(&self) -> Result<(), String> {
        let c = self;
        let bounded = [
            ("embedding_length", c.embd, 1 << 16),
            ("vocabulary", c.vocab, 1 << 22),
            ("context_length", c.context, 1 << 24),
            ("attention.head_count", c.heads, 1 << 12),
            ("attention.key_length", c.head_dim, 1 << 14),
            ("attention.q_lora_rank", c.q_lora_rank, 1 << 16),
            ("attention.sliding_window", c.window, 1 << 24),
            ("expert_count", c.experts, 1 << 12),
            ("expert_used_count", c.experts_used, 1 << 12),
            ("expert_feed_forward_length", c.expert_ffn, 1 << 16),
            ("attention.indexer.head_count", c.indexer_heads, 1 << 12),
            ("attention.indexer.key_length", c.indexer_dim, 1 << 14),
            ("attention.indexer.top_k", c.indexer_top_k, 1 << 24),
            ("attention.output_group_count", c.out_groups, 1 << 12),
            ("attention.output_lora_rank", c.out_lora_rank, 1 << 16),
            ("hyper_connection.count", c.hc, 64),
        ];
        for (key, v, max) in bounded {
            if v == 0 || v > max {
                return Err(format!("{key} = {v}: expected 1 to {max}"));
            }
        }
        if c.ratios.is_empty() || c.ratios.len() > MAX_LAYERS {
            return Err(format!(
                "{} blocks: expected 1 to {MAX_LAYERS}",
                c.ratios.len()
            ));
        }
        if let Some(r) = c.ratios.iter().find(|r| ![0, 4, 128].contains(*r)) {
            return Err(format!("compression ratio {r}: expected 0, 4 or 128"));
        }
        if c.sinkhorn_iters > 1024 || c.hash_layers > c.ratios.len() {
            return Err(
                "hyper_connection.sinkhorn_iterations or hash_layer_count out of range".into(),
            );
        }
        if !c.heads.is_multiple_of(c.out_groups) || c.experts_used > c.experts {
            return Err(
                "head count not divisible by output groups, or more experts used than exist".into(),
            );
        }
        if !c.rope_dims.is_multiple_of(2) || c.rope_dims > c.head_dim.min(c.indexer_dim) {
            return Err(format!(
                "rope.dimension_count {} must be even and at most both key lengths",
                c.rope_dims
            ));
        }
        if c.swiglu_clamp.len() < c.ratios.len()
            || c.swiglu_clamp.iter().any(|x| !(x.is_finite() && *x >= 0.0))
        {
            return Err("swiglu_clamp_exp: a finite limit ≥ 0 per block".into());
        }
        let eps = [c.eps_rms, c.eps_hc, c.rope_base, c.compress_rope_base];
        if eps.iter().any(|x| !(x.is_finite() && *x >= 0.0)) || !c.expert_weights_scale.is_finite()
        {
            return Err(
                "epsilons, RoPE bases and the expert weight scale must be finite numbers ≥ 0"
                    .into(),
            );
        }
        Ok(())
    }
}

/// Every tensor the configuration needs, with its shape (`ne`), in file order (after
/// [`Dsv4Config::validate`], which keeps these products small).
pub fn expected(c: &Dsv4Config) -> Vec<(String, Vec<usize>)> {
    let (e, v, hd, hc) = (c.embd, c.vocab, c.head_dim, c.hc);
    let (hc_dim, hc_mix) = (hc * e, (2 + hc) * hc);
    let mut out = vec![
        ("token_embd.weight".to_string(), vec![e, v]),
        ("output.weight".into(), vec![e, v]),
        ("output_hc_fn.weight".into(), vec![hc_dim, hc]),
        ("output_norm.weight".into(), vec![e]),
        ("output_hc_base.weight".into(), vec![hc]),
        ("output_hc_scale.weight".into(), vec![1]),
    ];
    for (l, &r) in c.ratios.iter().enumerate() {
        let mut t = |n: &str, ne: Vec<usize>| out.push((format!("blk.{l}.{n}"), ne));
        t("attn_norm.weight", vec![e]);
        t("attn_sinks.weight", vec![c.heads]);
        t("attn_q_a.weight", vec![e, c.q_lora_rank]);
        t("attn_q_a_norm.weight", vec![c.q_lora_rank]);
        t("attn_q_b.weight", vec![c.q_lora_rank, c.heads * hd]);
        t("attn_kv.weight", vec![e, hd]);
        t("attn_kv_a_norm.weight", vec![hd]);
        let (o_in, o_out) = (
            c.heads * hd / c.out_groups.max(1),
            c.out_lora_rank * c.out_groups,
        );
        t("attn_output_a.weight", vec![o_in, o_out]);
        t("attn_output_b.weight", vec![o_out, e]);
        for w in ["attn", "ffn"] {
            t(&format!("hc_{w}_fn.weight"), vec![hc_dim, hc_mix]);
            t(&format!("hc_{w}_base.weight"), vec![hc_mix]);
            t(&format!("hc_{w}_scale.weight"), vec![3]);
        }
        if r != 0 {
            let m = if r == 4 { 2 } else { 1 };
            t("attn_compressor_kv.weight", vec![e, m * hd]);
            t("attn_compressor_gate.weight", vec![e, m * hd]);
            t("attn_compressor_ape.weight", vec![m * hd, r]);
            t("attn_compressor_norm.weight", vec![hd]);
            if r == 4 {
                let id = c.indexer_dim;
                t("indexer.proj.weight", vec![e, c.indexer_heads]);
                t(
                    "indexer.attn_q_b.weight",
                    vec![c.q_lora_rank, c.indexer_heads * id],
                );
                t("indexer_compressor_kv.weight", vec![e, 2 * id]);
                t("indexer_compressor_gate.weight", vec![e, 2 * id]);
                t("indexer_compressor_ape.weight", vec![2 * id, r]);
                t("indexer_compressor_norm.weight", vec![id]);
            }
        }
        t("ffn_gate_inp.weight", vec![e, c.experts]);
        if l < c.hash_layers {
            t("ffn_gate_tid2eid.weight", vec![c.experts_used, v]);
        } else {
            t("exp_probs_b.bias", vec![c.experts]);
        }
        t("ffn_norm.weight", vec![e]);
        let (f, x) = (c.expert_ffn, c.experts);
        t("ffn_gate_exps.weight", vec![e, f, x]);
        t("ffn_down_exps.weight", vec![f, e, x]);
        t("ffn_up_exps.weight", vec![e, f, x]);
        t("ffn_gate_shexp.weight", vec![e, f]);
        t("ffn_down_shexp.weight", vec![f, e]);
        t("ffn_up_shexp.weight", vec![e, f]);
    }
    out
}
