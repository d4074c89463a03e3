"""The captions' cost at a real encoder's size: a randomly initialised CLIP text model shaped as CLIP ViT-L/14's
(width 768, 12 layers, 12 heads, 77 positions: Stable Diffusion 1.x's encoder; its weights random, its compute the
same), with bench/labelled.py's tokenizer of single characters, encodes 1,024 distinct captions into the cache
(captions.cached_embeddings, the code train.py runs) on this CPU; prints captions a second and the cache's bytes.
usage: OMP_NUM_THREADS=N python encode_cost.py FOLDER"""
import sys, time
from pathlib import Path

import torch
from transformers import CLIPTextConfig, CLIPTextModel

sys.path.insert(0, "/work/main")
import captions
from bench import labelled

folder = Path(sys.argv[1])
if not (folder / "config.json").is_file():
    labelled.write_random_clip(folder)  # the tokenizer (and a small model, replaced next)
    torch.manual_seed(0)
    config = CLIPTextConfig(vocab_size=138, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                            num_attention_heads=12, max_position_embeddings=77, bos_token_id=0, eos_token_id=1, pad_token_id=1)
    CLIPTextModel(config).save_pretrained(folder)
encoder = captions.load_text_encoder(str(folder))
texts = [f"{t.format(n)} number {i}" for i in range(103) for t in labelled.TEMPLATES for n in sorted(labelled.PHOTOS)][:1024]
root = folder.parent / f"cache-{time.time_ns()}"
start = time.perf_counter()
table = captions.cached_embeddings(encoder, texts + [""], root=root, log=None)
seconds = time.perf_counter() - start
size = sum(p.stat().st_size for p in table.folder.glob("piece-*.pt"))
print(f"threads {torch.get_num_threads()}: {len(texts) + 1} captions encoded in {seconds:.1f} s = {(len(texts) + 1) / seconds:.1f} captions/s; "
      f"cache {size / 1e6:.1f} MB = {size / (len(texts) + 1) / 1e3:.1f} kB a caption ({tuple(table.embeddings.shape)} {table.embeddings.dtype})")
