//! Prints the token ids of each argument (to compare with llama.cpp's llama-tokenize).
fn main() {
    let path = strata_model::fetch::cache_dir().join(strata_model::fetch::MODEL_FILE);
    let g = strata_model::Gguf::open(&path).unwrap();
    let tk = strata_model::ModelTokenizer::from_gguf(&g).unwrap();
    for a in std::env::args().skip(1) {
        println!("{:?} {:?}", a, tk.encode(&a).unwrap());
    }
}
