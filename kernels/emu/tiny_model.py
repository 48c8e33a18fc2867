# A tiny llama GGUF (2 layers, hidden 128, GQA 2:1, head size 64) with the default model's
# tokenizer and chat template and seeded random Q4_1 weights: small enough for the CUDA
# emulator to run the GPU-vs-CPU parity test end to end in about a minute.
# Usage: tiny_model.py SOURCE.gguf OUT.gguf
import sys, numpy as np, gguf
src = gguf.GGUFReader(sys.argv[1])
w = gguf.GGUFWriter(sys.argv[2], "llama")
H, L, NH, NKV, FF = 128, 2, 2, 1, 256
keep = [k for k in src.fields if k.startswith("tokenizer.")]
for k in keep:
    f = src.fields[k]
    t = f.types[0]
    if t == gguf.GGUFValueType.ARRAY:
        sub = f.types[1]
        if sub == gguf.GGUFValueType.STRING:
            vals = [bytes(f.parts[i]).decode("utf-8", "surrogateescape") for i in f.data]
        else:
            vals = [f.parts[i].tolist()[0] for i in f.data]
        w.add_array(k, vals)
    elif t == gguf.GGUFValueType.STRING:
        w.add_string(k, bytes(f.parts[f.data[0]]).decode())
    else:
        val = f.parts[f.data[0]].tolist()[0]
        {gguf.GGUFValueType.UINT32: w.add_uint32, gguf.GGUFValueType.INT32: w.add_int32,
         gguf.GGUFValueType.BOOL: w.add_bool, gguf.GGUFValueType.FLOAT32: w.add_float32}[t](k, val)
w.add_context_length(2048)
w.add_embedding_length(H)
w.add_block_count(L)
w.add_feed_forward_length(FF)
w.add_head_count(NH)
w.add_head_count_kv(NKV)
w.add_layer_norm_rms_eps(1e-5)
w.add_rope_freq_base(10000.0)
vocab = len(src.fields["tokenizer.ggml.tokens"].data)
rng = np.random.default_rng(0)
def q(name, shape, std):
    a = (rng.standard_normal(shape) * std).astype(np.float32)
    w.add_tensor(name, gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q4_1), raw_dtype=gguf.GGMLQuantizationType.Q4_1)
def f(name, n):
    w.add_tensor(name, (1 + 0.1 * rng.standard_normal(n)).astype(np.float32))
q("token_embd.weight", (vocab, H), 1.0)
hd = H // NH
for i in range(L):
    p = f"blk.{i}"
    f(f"{p}.attn_norm.weight", H)
    q(f"{p}.attn_q.weight", (NH * hd, H), 0.3)
    q(f"{p}.attn_k.weight", (NKV * hd, H), 0.3)
    q(f"{p}.attn_v.weight", (NKV * hd, H), 0.3)
    q(f"{p}.attn_output.weight", (H, NH * hd), 0.1)
    f(f"{p}.ffn_norm.weight", H)
    q(f"{p}.ffn_gate.weight", (FF, H), 0.1)
    q(f"{p}.ffn_up.weight", (FF, H), 0.1)
    q(f"{p}.ffn_down.weight", (H, FF), 0.1)
f("output_norm.weight", H)
w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
