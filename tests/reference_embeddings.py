"""Reference sentence embeddings for tests/embeddings.rs.

An independent implementation of what sentence-transformers computes for all-MiniLM-L6-v2
(BertModel forward, mean pooling over the attention mask, L2 normalisation), written with
numpy in float64 from the model's own files: HF `tokenizers` for the token ids, `safetensors`
for the weights. Usage: reference_embeddings.py MODEL_DIR < sentences (JSON list) > vectors.
"""
import json
import math
import sys

import numpy as np
from safetensors.numpy import load_file
from tokenizers import Tokenizer

model_dir = sys.argv[1]
cfg = json.load(open(f"{model_dir}/config.json"))
w = {k.removeprefix("bert."): v.astype(np.float64) for k, v in load_file(f"{model_dir}/model.safetensors").items()}
tok = Tokenizer.from_file(f"{model_dir}/tokenizer.json")
tok.no_truncation()
tok.no_padding()
heads, eps = cfg["num_attention_heads"], cfg["layer_norm_eps"]


def layer_norm(x, p):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w[p + ".weight"] + w[p + ".bias"]


def linear(x, p):
    return x @ w[p + ".weight"].T + w[p + ".bias"]


gelu = np.vectorize(lambda v: 0.5 * v * (1.0 + math.erf(v / math.sqrt(2.0))))


def embed(text):
    ids = tok.encode(text).ids
    n = len(ids)
    x = w["embeddings.word_embeddings.weight"][ids] + w["embeddings.position_embeddings.weight"][:n] + w["embeddings.token_type_embeddings.weight"][0]
    x = layer_norm(x, "embeddings.LayerNorm")
    d = x.shape[1] // heads
    for i in range(cfg["num_hidden_layers"]):
        p = f"encoder.layer.{i}"
        q, k, v = (linear(x, f"{p}.attention.self.{m}").reshape(n, heads, d).transpose(1, 0, 2) for m in ("query", "key", "value"))
        s = q @ k.transpose(0, 2, 1) / math.sqrt(d)
        s = np.exp(s - s.max(-1, keepdims=True))
        ctx = (s / s.sum(-1, keepdims=True)) @ v
        x = layer_norm(linear(ctx.transpose(1, 0, 2).reshape(n, -1), f"{p}.attention.output.dense") + x, f"{p}.attention.output.LayerNorm")
        h = gelu(linear(x, f"{p}.intermediate.dense"))
        x = layer_norm(linear(h, f"{p}.output.dense") + x, f"{p}.output.LayerNorm")
    pooled = x.mean(0)
    return (pooled / np.linalg.norm(pooled)).tolist(), n


out = [embed(t) for t in json.load(sys.stdin)]
json.dump({"vectors": [v for v, _ in out], "tokens": [n for _, n in out]}, sys.stdout)
