// Reference logits from llama.cpp for Strata's tiny test models (scripts/llamacpp/reference.py
// builds and runs this against llama.cpp's libllama; nothing of llama.cpp is committed).
//
// usage: logits MODEL.gguf PROMPTS.tsv [THREADS [KV]] > out.jsonl
// KV: f32 (default) or q8_0 (K and V caches as q8_0, which llama.cpp stores only with flash
// attention: -ctk q8_0 -ctv q8_0 -fa on).
// PROMPTS.tsv: one prompt a line: name <TAB> positions <TAB> decode steps <TAB> token ids
// (positions: comma-separated prompt positions whose whole logits are printed; the argmax of
// every position, its runner-up and the gap between them are printed). After the prompt, `decode steps` greedy tokens are decoded one
// at a time, each step's whole logits printed. F32 K/V caches and no flash attention: the
// values are then identical across runs, thread counts and batch splits.

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "llama.h"

static void quiet(enum ggml_log_level level, const char * text, void * user) {
    (void) user;
    if (level >= GGML_LOG_LEVEL_ERROR) {
        fputs(text, stderr);
    }
}

static void print_row(const float * l, int n) {
    printf("[");
    for (int i = 0; i < n; i++) {
        printf(i ? ",%.7g" : "%.7g", l[i]);
    }
    printf("]");
}

static int argmax(const float * l, int n) {
    int best = 0;
    for (int i = 1; i < n; i++) {
        if (l[i] > l[best]) {
            best = i;
        }
    }
    return best;
}

// The second likeliest token (ties: the lower id).
static int runner_up(const float * l, int n, int best) {
    int second = best == 0 ? 1 : 0;
    for (int i = 0; i < n; i++) {
        if (i != best && l[i] > l[second]) {
            second = i;
        }
    }
    return second;
}

int main(int argc, char ** argv) {
    if (argc < 3 || argc > 5) {
        fprintf(stderr, "usage: %s MODEL.gguf PROMPTS.tsv [THREADS [f32|q8_0]]\n", argv[0]);
        return 2;
    }
    const int threads = argc >= 4 ? atoi(argv[3]) : 2;
    const int q8_kv = argc == 5 && strcmp(argv[4], "q8_0") == 0;
    if (argc == 5 && !q8_kv && strcmp(argv[4], "f32") != 0) {
        fprintf(stderr, "KV type %s: expected f32 or q8_0\n", argv[4]);
        return 2;
    }
    llama_log_set(quiet, NULL);
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    struct llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) {
        fprintf(stderr, "cannot load %s\n", argv[1]);
        return 1;
    }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 1024;
    cp.n_batch = 1024;
    cp.n_ubatch = 1024;
    cp.n_seq_max = 1;
    cp.n_threads = threads;
    cp.n_threads_batch = threads;
    cp.type_k = q8_kv ? GGML_TYPE_Q8_0 : GGML_TYPE_F32;
    cp.type_v = q8_kv ? GGML_TYPE_Q8_0 : GGML_TYPE_F32;
    cp.flash_attn_type = q8_kv ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
    struct llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) {
        fprintf(stderr, "cannot create a context\n");
        return 1;
    }
    FILE * f = fopen(argv[2], "r");
    if (!f) {
        fprintf(stderr, "cannot open %s\n", argv[2]);
        return 1;
    }
    static char line[1 << 20];
    while (fgets(line, sizeof line, f)) {
        char * name = strtok(line, "\t");
        char * positions = strtok(NULL, "\t");
        char * steps_s = strtok(NULL, "\t");
        char * ids = strtok(NULL, "\t\n");
        if (!name || !positions || !steps_s || !ids) {
            continue;
        }
        int n = 0;
        static llama_token toks[4096];
        for (char * t = strtok(ids, " "); t && n < 4096; t = strtok(NULL, " ")) {
            toks[n++] = atoi(t);
        }
        llama_memory_clear(llama_get_memory(ctx), true);
        struct llama_batch b = llama_batch_init(n, 0, 1);
        for (int i = 0; i < n; i++) {
            b.token[i] = toks[i];
            b.pos[i] = i;
            b.n_seq_id[i] = 1;
            b.seq_id[i][0] = 0;
            b.logits[i] = 1;
        }
        b.n_tokens = n;
        if (llama_decode(ctx, b) != 0) {
            fprintf(stderr, "%s: decode failed\n", name);
            return 1;
        }
        printf("{\"name\":\"%s\",\"tokens\":%d,\"argmax\":[", name, n);
        for (int i = 0; i < n; i++) {
            printf(i ? ",%d" : "%d", argmax(llama_get_logits_ith(ctx, i), n_vocab));
        }
        // The runner-up and its gap to the argmax, per position: a near tie is told apart from
        // a wrong answer without keeping every row.
        printf("],\"runner_up\":[");
        for (int i = 0; i < n; i++) {
            const float * l = llama_get_logits_ith(ctx, i);
            printf(i ? ",%d" : "%d", runner_up(l, n_vocab, argmax(l, n_vocab)));
        }
        printf("],\"gap\":[");
        for (int i = 0; i < n; i++) {
            const float * l = llama_get_logits_ith(ctx, i);
            const int a = argmax(l, n_vocab);
            printf(i ? ",%.4g" : "%.4g", l[a] - l[runner_up(l, n_vocab, a)]);
        }
        printf("],\"logits\":{");
        int first = 1;
        for (char * p = strtok(positions, ","); p; p = strtok(NULL, ",")) {
            int at = atoi(p);
            if (at < 0 || at >= n) {
                continue;
            }
            printf(first ? "\"%d\":" : ",\"%d\":", at);
            print_row(llama_get_logits_ith(ctx, at), n_vocab);
            first = 0;
        }
        printf("},\"decode\":[");
        int next = argmax(llama_get_logits_ith(ctx, n - 1), n_vocab);
        llama_batch_free(b);
        int steps = atoi(steps_s);
        for (int s = 0; s < steps; s++) {
            struct llama_batch one = llama_batch_init(1, 0, 1);
            one.token[0] = next;
            one.pos[0] = n + s;
            one.n_seq_id[0] = 1;
            one.seq_id[0][0] = 0;
            one.logits[0] = 1;
            one.n_tokens = 1;
            if (llama_decode(ctx, one) != 0) {
                fprintf(stderr, "%s: decode step %d failed\n", name, s);
                return 1;
            }
            const float * l = llama_get_logits_ith(ctx, 0);
            printf(s ? ",{\"token\":%d,\"logits\":" : "{\"token\":%d,\"logits\":", next);
            print_row(l, n_vocab);
            printf("}");
            next = argmax(l, n_vocab);
            llama_batch_free(one);
        }
        printf("]}\n");
        fflush(stdout);
    }
    fclose(f);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
