//! A DeepSeek-V4 model's hyper-parameters, and the tensors they imply with their shapes:
//! what a file must hold (`Dsv4::new` checks it).

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

/// Every tensor the configuration needs, with its shape (`ne`), in file order.
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
