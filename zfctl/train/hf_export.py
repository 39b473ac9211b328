"""`export`: a checkpoint -> a folder `transformers.AutoModelForCausalLM.from_pretrained` loads.

The checkpoint's ``model.safetensors`` (or FSDP2 shard files) holds the weights as training left them; with
``overlap_step`` one CPU update may still be in flight inside the optimizer state. Export rebuilds
the optimizer on the CPU, loads that state and flushes it (zfctl/train/weights.py), so the
exported weights are exactly the finished model (the one the final evaluation scored), not one
interval behind.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import urllib.error
import urllib.request
from pathlib import Path

from rich.console import Console

from zfctl.errors import UserError
from zfctl.plan.io import dump_plan_yaml, load_plan_yaml
from zfctl.train import checkpoint as ck
from zfctl.train.data.prompt_format import prompt_template
from zfctl.train.lock import held
from zfctl.train.weights import EXPORT_MARKER, final_weights, final_weights_files, quiet_transformers
from zfctl.writable import check_writable, current_umask

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def check_hub(repo_id: str) -> str:
    """Fail fast (before any work) unless an upload to ``repo_id`` can work; return the token."""
    if not _REPO_ID.match(repo_id):
        raise UserError(f"--push-to-hub {repo_id!r}: expected a repo id like your-name/model-name")
    from huggingface_hub import constants, get_token

    later = f"export without --push-to-hub, then upload the folder with `hf upload {repo_id} DIR`"
    if constants.HF_HUB_OFFLINE:
        raise UserError(f"--push-to-hub {repo_id}: HF_HUB_OFFLINE is set, the hub cannot be reached; {later}")
    try:  # any HTTP answer, even an error status, proves the hub is reachable
        urllib.request.urlopen(constants.ENDPOINT, timeout=5).close()
    except urllib.error.HTTPError:
        pass
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise UserError(f"--push-to-hub {repo_id}: cannot reach the Hugging Face hub at "
                        f"{constants.ENDPOINT} ({reason}); {later}") from None
    token = get_token()
    if not token:
        raise UserError(f"--push-to-hub {repo_id}: no Hugging Face token; run `hf auth login` or set "
                        f"HF_TOKEN, or {later}")
    return token


def export(ckpt_dir: Path, output: Path, *, force: bool = False, push_to_hub: str | None = None) -> Path:
    """Write ``output`` (weights as safetensors, config, tokenizer, the run plan); return it.

    The folder is assembled next to ``output`` and renamed into place, so a failure never leaves a
    half-written export; ``force`` replaces an earlier export (never a file or a folder export did
    not write) only once the new one is complete.
    """
    output = Path(output)
    token = check_hub(push_to_hub) if push_to_hub else None
    notes: list[str] = []
    info = ck.resolve_checkpoint(Path(ckpt_dir), notes)
    # Every file export reads, checked against its digest before anything is loaded or written.
    ck.verify_checkpoint(info, final_weights_files(info))
    check_export_dest(output, force)
    check_writable(output.parent, "--output", shown=output)
    for note in notes:
        Console(stderr=True).print(f"note: {note}", style="yellow", markup=False, highlight=False,
                                   soft_wrap=True)
    # Hold the run folder's lock while reading: a live run would rotate checkpoints away under
    # us. A folder nobody can write to (a read-only copy) needs no lock and is read without one.
    if info.path.parent.name != ck.CHECKPOINTS:  # a checkpoint folder outside a run folder
        return _export(info, output, token=token, push_to_hub=push_to_hub)
    with held(info.path.parent.parent, optional=True):
        return _export(info, output, token=token, push_to_hub=push_to_hub)


def check_export_dest(output: Path, force: bool) -> None:
    """Refuse what --output must not replace: a file, a foreign folder, or (without force) any
    non-empty folder. ``--force`` replaces only a folder an earlier export wrote (it holds
    ``zfctl-export.json``)."""
    if output.exists() and not output.is_dir():
        raise UserError(f"--output {output} is a file, not a folder; export never replaces a file "
                        "(not even with --force): choose another --output")
    if not output.exists() or not any(output.iterdir()):
        return
    if not force:
        raise UserError(f"export folder {output} already exists and is not empty; pass --force to "
                        "replace an earlier export, or choose another --output")
    if not (output / EXPORT_MARKER).is_file():
        raise UserError(f"--output {output} is not empty and was not written by zfctl export (no "
                        f"{EXPORT_MARKER}); --force only replaces earlier exports: choose a new or empty "
                        "--output")


def _export(info: ck.CheckpointInfo, output: Path, *, token: str | None, push_to_hub: str | None) -> Path:
    plan = load_plan_yaml(info.path / ck.PLAN_FILE)
    from zfctl.train.models.load import load_tokenizer

    tokenizer = load_tokenizer(plan.model)
    # The prompt format the run trained on (alpaca's, or the chat template it rendered with):
    # save_pretrained writes it as chat_template.jinja, so apply_chat_template on the export
    # builds the prompt the model saw, never a tokenizer's own template it was not trained on.
    tokenizer.chat_template = prompt_template(plan.data, tokenizer)
    model = final_weights(info, plan)

    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(f".{output.name}.tmp-export")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with quiet_transformers():
            model.save_pretrained(tmp)  # safetensors; tied weights stored once
        tokenizer.save_pretrained(tmp)
        dump_plan_yaml(plan, tmp / "zfctl-plan.yaml")
        (tmp / EXPORT_MARKER).write_text(json.dumps(
            {"checkpoint": str(info.path.resolve()), "step": info.step, "zfctl_version": info.version},
            indent=1) + "\n", encoding="utf-8")
        # safetensors writes its file 0600; an export is meant to be shared and loaded by others
        # like every other file here: 0666 less the umask.
        for f in tmp.iterdir():
            f.chmod(0o666 & ~current_umask())
        if output.exists():
            trash = output.with_name(f".{output.name}.trash-export")
            shutil.rmtree(trash, ignore_errors=True)
            os.rename(output, trash)
            os.rename(tmp, output)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.rename(tmp, output)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    if push_to_hub:
        from huggingface_hub import HfApi

        api = HfApi(token=token)
        api.create_repo(push_to_hub, exist_ok=True)
        api.upload_folder(folder_path=str(output), repo_id=push_to_hub,
                          commit_message=f"zfctl export of {info.path.name}")
    return output
