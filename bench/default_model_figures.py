"""`moemesh bench default-model [--per-book 8] [--num-verses 200] [--model DIR]`: the measured figures of the
default model (models/kjv-dsv4-mini, or --model), on the CPU, written to bench/results/default-model-cpu-<UTC>.json
(bench.results_io).

1. validation loss / perplexity: read from the training log beside the checkpoint (float weights
   and the exported FP8/FP4 files, both measured by `tools.train` on the held-out chapters);
2. recitation: starts `moemesh serve` (all services, CPU) and asks for `--num-verses` verses by
   reference ("Recite John 3:16.") through /v1/chat/completions at temperature 0; a verse counts
   when the answer equals the KJV text exactly. Half the verses come from the well-known chapters
   (oversampled in training, `tools.corpus.splits.DEFAULT_PROTECTED_CHAPTERS`), half from all other
   chapters, both drawn with a fixed seed; the fraction is reported overall and per group;
   `--per-book N` (default 8: 528 verses): the whole-book sample of `bench.default_model_recitation`,
   N verses from each of the 66 books (none from held-out chapters), recited by reference through
   /v1/chat/completions and continued from their first words through /v1/completions, both at
   temperature 0 and exact-match; fractions overall and per book ("book_recitation");
3. three sample continuations through /v1/completions at temperature 0;
4. drafter: mean accepted drafts per verify step at temperature 0 and 1, simulated offline with
   the model core, the DSpark drafter and the server's verifier (`bench.default_model_offline`);
5. expert-load skew per layer from gate counts over the held-out text (`common.placement.stats`);
6. `--perplexity`: held-out loss / perplexity measured here on the checkpoint's files (model core,
   fp32) over the validation windows of the dataset, reported apart from the recitation figures.
Needs the `bible` program (the verse texts) and the dataset in .traindata/kjv-recite for 5 and 6.
`--skip-offline` leaves out 4 and 5.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from moemesh.bench.results_io import write_result

REPO_ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO_ROOT / "models" / "kjv-dsv4-mini"
DATA_DIR = REPO_ROOT / ".traindata" / "kjv-recite"
QUESTION = "Recite {ref}."
CONTINUATION_PROMPTS = ("Genesis 1:1 In the beginning God", "Psalms 23:1 The LORD is my shepherd;", "Matthew 5:5 Blessed are the")
ACCEPTANCE_PROMPTS = ("Genesis 1:1 In the beginning God", "John 3:16 For God so loved",
                      "Psalms 23:1 The LORD is my shepherd;", "Proverbs 3:5 Trust in the LORD")
SEED = 1611


def build_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m moemesh.bench.default_model_figures", description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-verses", type=int, default=200,
                        help="well-known / other split sample (0: none)")
    parser.add_argument("--per-book", type=int, default=8,
                        help="verses per book of the whole-book sample (0: none; 8 gives 528 verses)")
    parser.add_argument("--no-continuation", action="store_true", help="whole-book sample: recitation only")
    parser.add_argument("--model", type=Path, default=MODEL_DIR, help="checkpoint to serve and measure")
    parser.add_argument("--skip-offline", action="store_true", help="no drafter acceptance / expert skew")
    parser.add_argument("--perplexity", action="store_true", help="held-out perplexity of the checkpoint's files")
    parser.add_argument("--perplexity-windows", type=int, default=None, help="validation windows (default all)")
    parser.add_argument("--concurrency", type=int, default=8, help="chat requests in flight")
    parser.add_argument("--acceptance-tokens", type=int, default=48, help="tokens generated per acceptance prompt")
    parser.add_argument("--skew-windows", type=int, default=16, help="held-out windows counted for the skew")
    parser.add_argument("--out-dir", type=Path, default=None, help="where the result JSON goes (default bench/results)")
    return parser


def choose_verses(num_verses: int, seed: int = SEED):
    """(well-known, other) verse lists, half each, seeded; `bible` provides the texts."""
    from moemesh.tools.corpus.kjv import load_verses
    from moemesh.tools.corpus.splits import DEFAULT_PROTECTED_CHAPTERS

    verses = load_verses()
    well_known_chapters = set(DEFAULT_PROTECTED_CHAPTERS)
    well_known = [v for v in verses if v.chapter_key in well_known_chapters]
    other = [v for v in verses if v.chapter_key not in well_known_chapters]
    rng = random.Random(seed)
    num_well_known = num_verses // 2
    return rng.sample(well_known, num_well_known), rng.sample(other, num_verses - num_well_known)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """`moemesh serve` as a child process, stopped with SIGTERM on exit."""

    def __init__(self, log_path: Path, model_dir: Path = MODEL_DIR) -> None:
        self.port = _free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "w", encoding="utf-8")
        command = [sys.executable, "-m", "moemesh.cli", "serve", "--port", str(self.port), "--model", str(model_dir)]
        self.process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=self.log, stderr=self.log, text=True)

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"moemesh serve exited with {self.process.returncode}; log {self.log.name}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=5).status_code == 200:
                    self.model_id = httpx.get(f"{self.base_url}/v1/models", timeout=5).json()["data"][0]["id"]
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise RuntimeError(f"moemesh serve not ready after {timeout_s:.0f}s; log {self.log.name}")

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


def recitation(base_url: str, model: str, well_known, other, concurrency: int) -> dict:
    import httpx

    def ask(verse) -> dict:
        body = {"model": model, "temperature": 0, "max_tokens": 160,
                "messages": [{"role": "user", "content": QUESTION.format(ref=verse.reference)}]}
        reply = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=600).json()
        answer = reply["choices"][0]["message"]["content"]
        return {"reference": verse.reference, "expected": verse.text, "answer": answer,
                "exact": answer.strip() == verse.text}

    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        groups = {name: list(pool.map(ask, verses)) for name, verses in (("well_known", well_known), ("other", other))}
    everything = groups["well_known"] + groups["other"]

    def fraction(rows) -> float:
        return sum(r["exact"] for r in rows) / max(1, len(rows))

    return {"question": QUESTION, "num_verses": len(everything), "fraction_exact": fraction(everything),
            "num_well_known": len(groups["well_known"]), "fraction_exact_well_known": fraction(groups["well_known"]),
            "num_other": len(groups["other"]), "fraction_exact_other": fraction(groups["other"]),
            "seconds": round(time.monotonic() - started, 1), "answers": everything}


def continuations(base_url: str, model: str) -> list[dict]:
    import httpx

    rows = []
    for prompt in CONTINUATION_PROMPTS:
        body = {"model": model, "prompt": prompt, "max_tokens": 40, "temperature": 0}
        reply = httpx.post(f"{base_url}/v1/completions", json=body, timeout=600).json()
        rows.append({"prompt": prompt, "continuation": reply["choices"][0]["text"]})
    return rows


def training_figures(model_dir: Path) -> dict:
    log_path = model_dir / "train_log.jsonl"
    if not log_path.exists():
        return {}
    events = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    by_event = {e["event"]: e for e in events}
    return {"float_weights": by_event.get("target.validation"), "exported_checkpoint": by_event.get("export.validation"),
            "target_steps": by_event.get("target.steps_fixed", {}).get("total_steps"),
            "drafter_teacher_forced_greedy": by_event.get("drafter.validation_acceptance")}


def held_out_perplexity(model_dir: Path, num_windows: int | None) -> dict:
    """Loss / perplexity of the checkpoint's files on the held-out chapters (validation windows)."""
    import numpy as np

    from moemesh.tools.train.evaluate import reference_logits_fn, validation_loss
    from moemesh.tools.train.export import load_reference

    ids = np.load(DATA_DIR / "validation_ids.npy", allow_pickle=False)[:num_windows]
    mask = np.load(DATA_DIR / "validation_loss_mask.npy", allow_pickle=False)[:num_windows]
    started = time.monotonic()
    model, _ = load_reference(model_dir)
    figures = validation_loss(reference_logits_fn(model), ids, mask, 4, "cpu")
    manifest = json.loads((DATA_DIR / "manifest.json").read_text(encoding="utf-8"))
    return {**figures, "num_windows": int(ids.shape[0]), "held_out_chapters": manifest["validation_chapters"],
            "seconds": round(time.monotonic() - started, 1)}


def offline_figures(args) -> dict:
    import numpy as np
    import torch

    from moemesh.bench.default_model_offline import routing_stats, speculative_acceptance
    from moemesh.common.model.dspark import DSparkDrafter
    from moemesh.tools.corpus.special_tokens import BOS_ID, EOS_ID
    from moemesh.tools.corpus.tokenizer import load_tokenizer
    from moemesh.tools.train.export import load_reference

    torch.manual_seed(SEED)
    model, reader = load_reference(args.model)
    config = reader.config
    tokenizer = load_tokenizer(args.model)
    drafter = DSparkDrafter.from_state_dict(config, reader.load_mtp(config), model.side.embed, model.side.head)
    prompts = [[BOS_ID] + tokenizer.encode(p, add_special_tokens=False).ids for p in ACCEPTANCE_PROMPTS]
    acceptance = {}
    for temperature in (0.0, 1.0):
        started = time.monotonic()
        figure = speculative_acceptance(model, drafter, prompts, temperature, args.acceptance_tokens, EOS_ID, SEED)
        row = dataclasses.asdict(figure)
        row["texts"] = [tokenizer.decode(list(o)) for o in row.pop("outputs")]
        row["seconds"] = round(time.monotonic() - started, 1)
        acceptance[f"temperature_{temperature:g}"] = row
    validation_ids = np.load(DATA_DIR / "validation_ids.npy", allow_pickle=False)[: args.skew_windows]
    stats = routing_stats(model, [torch.from_numpy(w.astype(np.int64)) for w in validation_ids])
    skew = [{"layer": layer, "router": config.mlp_layer_types[layer].value, **dataclasses.asdict(s)}
            for layer, s in enumerate(stats.skews())]
    return {"acceptance": acceptance, "acceptance_prompts": list(ACCEPTANCE_PROMPTS),
            "expert_skew": {"num_windows": int(validation_ids.shape[0]), "num_activations": stats.num_activations(),
                            "per_layer": skew, "counts": stats.counts()}}


def main(argv: list[str] | None = None) -> int:
    args = build_arg_parser().parse_args(argv)
    args.model = args.model.resolve()
    model_name = str(args.model.relative_to(REPO_ROOT)) if args.model.is_relative_to(REPO_ROOT) else str(args.model)
    results: dict = {"model": model_name, "command": " ".join(["moemesh bench default-model"] + (argv if argv is not None else sys.argv[1:])),
                     "validation": training_figures(args.model)}
    summary: dict = {}
    if args.num_verses or args.per_book:
        with tempfile.TemporaryDirectory() as tmp, Server(Path(tmp) / "serve.log", args.model) as server:
            server.wait_ready()
            results["continuations"] = continuations(server.base_url, server.model_id)
            if args.per_book:
                from moemesh.bench.default_model_recitation import book_sample, run_book_sample
                from moemesh.tools.corpus.kjv import load_verses

                sample = book_sample(load_verses(), args.per_book, SEED)
                book = run_book_sample(server.base_url, server.model_id, sample, args.concurrency, not args.no_continuation)
                results["book_recitation"] = {"per_book": args.per_book, "seed": SEED, **book}
                summary["book_recitation"] = {k: book[k] for k in (
                    "num_verses", "num_books", "recitation_fraction_exact", "continuation_fraction_exact",
                    "books_all_recited", "books_none_recited", "seconds")}
                print(json.dumps(summary["book_recitation"]), flush=True)
            if args.num_verses:
                well_known, other = choose_verses(args.num_verses)
                results["recitation"] = recitation(server.base_url, server.model_id, well_known, other, args.concurrency)
                summary["recitation"] = {k: v for k, v in results["recitation"].items() if k != "answers"}
                print(json.dumps(summary["recitation"]), flush=True)
    if args.perplexity:
        results["held_out_perplexity"] = held_out_perplexity(args.model, args.perplexity_windows)
        summary["held_out_perplexity"] = {k: results["held_out_perplexity"][k] for k in ("loss", "perplexity", "num_tokens")}
    if not args.skip_offline:
        results.update(offline_figures(args))
        summary["acceptance"] = {k: v["mean_accepted"] for k, v in results["acceptance"].items()}
        summary["max_over_mean"] = [round(r["max_over_mean"], 3) for r in results["expert_skew"]["per_layer"]]
    out = write_result("default-model", results, command=results["command"], out_dir=args.out_dir, tag="cpu")
    print(json.dumps({"out": str(out), **{k: v for k, v in summary.items() if k in ("acceptance", "max_over_mean",
                                                                                  "held_out_perplexity")}}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
