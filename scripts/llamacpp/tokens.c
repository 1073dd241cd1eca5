// Reference token ids from llama.cpp for Strata's tiny tokenizer files (scripts/llamacpp/tokens.py
// builds and runs this against llama.cpp's libllama; nothing of llama.cpp is committed).
//
// usage: tokens MODEL.gguf TEXTS > out.jsonl
// TEXTS: the texts, each ended by a NUL byte. One JSON line per text: the ids without special
// tokens added ("plain") and with them (BOS where the vocabulary adds one: "special"), special
// tokens written in the text recognised in both; and without either ("text": parse_special
// false, control tokens written in the text are their characters, user-defined ones still
// their ids).

#include <stdbool.h>
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

static void print_ids(const struct llama_vocab * v, const char * text, int len, bool add,
                      bool parse) {
    int cap = len + 8;
    llama_token * ids = malloc(sizeof(llama_token) * cap);
    int n = llama_tokenize(v, text, len, ids, cap, add, parse);
    if (n < 0) {
        cap = -n;
        ids = realloc(ids, sizeof(llama_token) * cap);
        n = llama_tokenize(v, text, len, ids, cap, add, parse);
    }
    printf("[");
    for (int i = 0; i < n; i++) {
        printf(i ? ",%d" : "%d", ids[i]);
    }
    printf("]");
    free(ids);
}

int main(int argc, char ** argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: tokens MODEL.gguf TEXTS\n");
        return 2;
    }
    llama_log_set(quiet, NULL);
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    mp.vocab_only = true;
    struct llama_model * m = llama_model_load_from_file(argv[1], mp);
    if (!m) {
        fprintf(stderr, "cannot load %s\n", argv[1]);
        return 1;
    }
    const struct llama_vocab * v = llama_model_get_vocab(m);
    FILE * f = fopen(argv[2], "rb");
    if (!f) {
        return 1;
    }
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fseek(f, 0, SEEK_SET);
    char * all = malloc(size + 1);
    if (fread(all, 1, size, f) != (size_t) size) {
        return 1;
    }
    fclose(f);
    for (long at = 0; at < size;) {
        int len = (int) strlen(all + at);
        printf("{\"plain\":");
        print_ids(v, all + at, len, false, true);
        printf(",\"special\":");
        print_ids(v, all + at, len, true, true);
        printf(",\"text\":");
        print_ids(v, all + at, len, false, false);
        printf("}\n");
        at += len + 1;
    }
    free(all);
    llama_model_free(m);
    llama_backend_free();
    return 0;
}
