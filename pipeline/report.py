"""The run report's markdown, built from the stage output files (pure: no Prefect, no MLflow; the tracking run's
URL and the teachers' names come in as strings): what a reviewer asks first (data, distillation, tokenizer,
training, every score by name, the promotion decision, where the tracking run is).
``tasks.report.publish_report`` publishes it as Prefect artifacts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from pipeline.average import CHOICE
from pipeline.config import RunConfig
from pipeline.engines import GATE


def _read(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def _scores_rows(scores: dict) -> list[str]:
    """The markdown rows of :func:`score_rows`: named scores bold with what they are and their signature."""
    out = []
    for r in score_rows(scores):
        if r["named"]:
            sig = f" `{r['signature']}`".replace("|", "\\|") if r["signature"] else ""  # | splits cells
            out.append(f"| {r['split']} ({r['set']}) | {r['metric']} | **{r['value']:.2f}** | {r['what']}{sig} |")
        else:
            out.append(f"| {r['split']} ({r['set']}) | {r['metric']} | {r['value']:.4g} | |")
    return out


def render_report(cfg: RunConfig, stages: dict[str, tuple[Path, bool]], decision: dict | None,
                  tracking_url: str | None, teachers: Sequence[str] = ()) -> str:
    """The report's markdown from the stage outputs (``stages``: name -> (path, reused from cache)); ``teachers``
    names the teachers of a ``distill`` stage (registered versions; default: their checkpoint files)."""
    corpus, shards = _read(stages["data"][0] / "manifest.json"), _read(stages["shards"][0] / "manifest.json")
    summary = _read(stages["train"][0] / "train_summary.json")
    scores = _read(stages["evaluate"][0])
    out = [f"# {cfg.name}: {cfg.data.src_lang}->{cfg.data.tgt_lang}, preset `{cfg.preset}`", ""]
    if tracking_url:
        out += [f"Tracking run: [{tracking_url}]({tracking_url})", ""]
    out += ["## Stages", "", "| stage | output | cache |", "|---|---|---|"]
    out += [f"| {name} | `{path}` | {'reused' if cached else 'ran'} |" for name, (path, cached) in stages.items()]
    out += ["", "## Data", "", "| split | name | pairs |", "|---|---|---|"]
    out += [f"| {k} | {s['name'] if 'name' in s else ''} | {s['rows']:,} |" for k, s in corpus["splits"].items()]
    clean = corpus["splits"]["train"]["cleaning"]
    out += ["", f"Training pairs read {clean['read']:,}, kept {clean['kept']:,}; removed by rule: "
            + ", ".join(f"{r['rule']} {r['removed']:,}" for r in clean["rules"]), ""]
    if boms := [f for es in corpus["inputs"].values() for e in es for f in e.get("bom_stripped", [])]:
        out += [f"A UTF-8 byte order mark opening {len(boms)} file(s) was dropped: "
                + ", ".join(f"`{f}`" for f in boms) + ".", ""]
    if "distill" in stages:
        out += _distill_rows(_read(stages["distill"][0] / "manifest.json")["distillation"], teachers)
    train = shards["splits"]["train"]
    out += ["## Tokenizer", "", f"Vocabulary {shards['tokenizer'].get('vocab_size', '?')}; training split "
            f"{train['src']['tokens']:,} source / {train['tgt']['tokens']:,} target tokens, mean length "
            f"{train['src']['mean_len']:.1f} / {train['tgt']['mean_len']:.1f}, unknown rate "
            f"{train['src']['unk_rate']:.4%} / {train['tgt']['unk_rate']:.4%}.", ""]
    dev = summary.get("final_dev") or {}
    out += ["## Training", "", f"{summary['steps']:,} updates, {summary['epoch']} epochs, stopped by "
            f"`{summary['stopped_by']}` after {summary['wall_seconds'] / 60:.1f} min on {summary['world_size']} "
            f"process(es); {summary['tokens']['tgt']:,} target tokens this invocation"
            + (f"; final dev loss {dev['dev_loss']:.3f}, ppl {dev['dev_ppl']:.2f}." if dev else "."), ""]
    if "machine" in summary:  # runs before the record have none
        recipe = summary.get("recipe") or "none"
        out += [f"Machine: {summary['machine']}, trained in {summary['precision']}; compute recipe `{recipe}`"
                + ("" if recipe == "none" else f" (the config's `recipes.{recipe}`, applied over its YAML files)")
                + ".", ""]
    if sched := summary.get("schedule"):  # runs before the record have none
        fitted = (f", fitted to the {sched['predicted_updates']:,} updates predicted for the clock budget"
                  if sched["kind"] == "budget" and sched["predicted_updates"] else "")
        out += [f"Learning-rate schedule `{sched['kind']}`: warm-up to the peak {sched['peak_lr']:.3g} at update "
                f"{sched['warmup_steps']:,}{fitted}; inverse square root decay from update "
                f"{sched['decay_from']:,}.", ""]
    choice = stages["average"][0].parent / CHOICE
    if choice.is_file():
        c = _read(choice)
        out += ["## Averaging", "", f"N chosen on {c['metric']}: **{c['chosen_n']}**.", "",
                "| N | steps | dev |", "|---|---|---|"]
        out += [f"| {r['n']} | {r['steps'][0]}-{r['steps'][-1]} | {r['dev']:.2f} |" for r in c["candidates"]]
        out += [""]
    out += ["## Scores", "", "| split | score | value | what |", "|---|---|---|---|", *_scores_rows(scores), ""]
    if "export" in stages:
        out += _export_rows(_read(stages["export"][0] / GATE))
    if decision:
        verdict = {"promoted": "promoted to **champion**", "not promoted": "**not promoted**",
                   "no decision": "no decision"}[decision["decision"]]
        out += ["## Registry", "", f"Version {decision['version']}: {verdict}. {decision['reason']}", ""]
        rows = evidence_rows(decision)
        if rows:
            cell = lambda v: v.replace("|", "\\|")  # noqa: E731  (sacreBLEU signatures hold |)
            out += ["| evidence | value |", "|---|---|", *(f"| {k} | {cell(v)} |" for k, v in rows), ""]
    return "\n".join(out)


def _distill_rows(entry: dict, teachers: Sequence[str]) -> list[str]:
    """The distillation: who translated the training sources, how, and what the filters dropped."""
    names = teachers or [t["path"] for t in entry["teachers"]]
    decode = entry["decode"]
    out = ["## Distillation", "",
           f"Training targets translated by {', '.join(f'`{n}`' for n in names)}"
           + (f" (an ensemble of {len(names)})" if len(names) > 1 else "")
           + f": beam {decode['beam_size']}, length penalty {decode['length_penalty']}, n-best {entry['nbest']}, "
           f"selection `{entry['select']}`; source corpus `{entry['source_corpus']['fingerprint'][:16]}`. Dev and "
           "test keep their human references.", "",
           f"Training sources read {entry['read']:,}, kept {entry['kept']:,}; removed by rule: "
           + ", ".join(f"{r['rule']} {r['removed']:,}" for r in entry["rules"]) + "."]
    if entry["truncated"]:
        out[-1] += f" {entry['truncated']:,} source(s) were cut to the teachers' positions."
    if entry.get("references"):  # distill.keep_original
        out[-1] += f" The {entry['references']:,} human pairs train beside them (distill.keep_original)."
    return out + [""]


def _export_rows(gate: dict) -> list[str]:
    """The export's quality gate: what serves, and the numbers that decided it."""
    verdict = ("**passed**: the registered model serves with CTranslate2" if gate["passed"] else
               "**refused**: the registered model serves with PyTorch")
    return ["## Serving export", "",
            f"CTranslate2, {gate['quantization']} weights: {verdict} (a drop of at most {gate['max_bleu_drop']:.2f} "
            f"sacreBLEU on {gate['split']}, {gate['sentences']:,} sentences, is allowed).", "",
            "| | value |", "|---|---|",
            f"| PyTorch sacreBLEU | {gate['torch_bleu']:.2f} |",
            f"| CTranslate2 sacreBLEU | {gate['export_bleu']:.2f} |",
            f"| drop (95% CI) | {gate['drop']:+.2f} [{gate['drop_ci95'][0]:+.2f}, {gate['drop_ci95'][1]:+.2f}] |",
            f"| p-value (paired bootstrap) | {gate['p_value']:.4f} |",
            f"| identical translations | {gate['identical']:.1%} |",
            f"| CTranslate2 speed on {gate['split']} | {gate['export_sentences_per_s']:.1f} sentences/s |", ""]


def score_rows(scores: dict) -> list[dict]:
    """One row per (split, score) of a ``scores.json``: split, set name, metric, value, and for named scores
    ({"score", "what", "signature"}) what it is and its signature; plain numbers stand alone (``named`` False).
    The report's score table and the scores table artifact."""
    rows = []
    for key, split in scores["splits"].items():
        for metric, value in split.items():
            named = isinstance(value, dict) and "score" in value
            if named or isinstance(value, float):
                rows.append({"split": key, "set": split.get("name", ""), "metric": metric, "named": named,
                             "value": float(value["score"]) if named else value,
                             "what": value.get("what", "") if named else "",
                             "signature": value.get("signature", "") if named else ""})
    return rows


def evidence_rows(decision: dict) -> list[tuple[str, str]]:
    """The promotion decision's evidence as (what, value) rows: the paired test and every test-set guard."""
    c = decision.get("comparison")
    if not c:
        return []
    rows = [("promotion set", f"{decision['set']} ({decision['set_role']} set, {c['segments']} segments)"),
            (c["metric"], f"{c['challenger']:.2f} (champion version {decision['champion_version']}: "
                          f"{c['champion']:.2f})"),
            ("delta", f"{c['delta']:+.2f}"), ("95% CI of delta", f"[{c['ci_low']:+.2f}, {c['ci_high']:+.2f}]"),
            ("p-value (paired bootstrap)", f"{c['p_value']:.4f}"), ("test", c["signature"])]
    for g in decision["guards"]:
        drop = "new set" if g["drop"] is None else f"{g['champion']:.2f} -> {g['challenger']:.2f}"
        failed = " **failed**" if g["set"] in decision["failed_guards"] else ""
        rows.append((f"guard {g['set']} {g['metric']}", drop + failed))
    return rows
