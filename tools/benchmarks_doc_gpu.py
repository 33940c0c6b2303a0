"""The sections of docs/benchmarks.md whose figures were measured on the accelerator machine:
FP16 training on one GPU, kernel-level figures and the step profile, activation checkpointing
and offloading, multi-GPU, local_gpu in Docker and Slurm with a GPU node. Each returns the
section's lines (without its heading) for tools/gen_benchmarks_doc.py, which orders the page.
"""

from __future__ import annotations

from benchmark_results import fmt, load

__all__ = ["fp16_section", "profile_section", "step_profile_section", "memory_section",
           "multi_gpu_section", "gpu_docker_section", "slurm_gpu_section"]


def fp16_section() -> list[str]:
    d = load("fp16_gpu")
    if not d:
        return ["No GPU results yet."]
    m = d["meta"]
    lines = [f"Machine: {m.get('gpu')}, torch {m.get('torch')} (CUDA {m.get('cuda')}), Python "
             f"{m.get('python')}. MFU = tokens/s x (6*N + 12*L*h*s) / "
             f"{m.get('peak_flops', 989e12) / 1e12:.0f} TFLOP/s, with N counted two ways: "
             "**MFU** counts the tied token embedding, which is also the LM head's weight and so "
             "does real matmul work (nanoGPT's estimate_mfu convention; the issue's anchors, e.g. "
             "52.5k tokens/s = 48% at 1.3B, use it); **MFU excl. emb.** leaves out both "
             f"embedding tables ({m.get('flops_per_token')}). Optimizer step: "
             f"{m.get('opt_step')}; floor = 28 B/param / "
             f"{m.get('hbm_bytes_per_s', 4.3e12) / 1e12:.1f} TB/s (the device's copy "
             "bandwidth).",
             "", "All runs below: `bash benchmarks/gpu_tests.sh` on the accelerator machine, "
             "one process per run; each table names its own command.", ""]
    for r in d["results"]:
        c = r["config"]
        title = (f"### {r['preset']}: {c['layers']} layers, hidden {c['hidden']}, "
                 f"{c.get('heads', '?')} heads, seq {c['seq']}, batch {c['batch']}, vocab "
                 f"{c.get('vocab', '?')}" + (" (torch.compile)" if r.get("compiled") else "")
                 + (", SDPA prefers cuDNN" if r.get("sdpa") == "cudnn" else "")
                 + (f" — {r['label']}" if r.get("label") else ""))
        command = r.get("command") or (
            "bash benchmarks/gpu_tests.sh (the earlier version of the script: smp arm with "
            "F.cross_entropy on the fp32 logits, before the fused loss)")
        lines += [title, "", f"Command: `{command}`." if r.get("command") else
                  f"Command: {command}.", "",
                  f"{r['params_total'] / 1e6:.0f}M parameters "
                  f"({r['params_non_embedding'] / 1e6:.0f}M without embeddings), "
                  f"{r['steps']} timed steps after {r['warmup']} warm-up.", "",
                  "| arm | tokens/s | MFU | MFU excl. emb. | peak GiB | opt step ms (floor) | "
                  "x floor | of it to end of clip ms | final loss |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for a in r["arms"]:
            lmh = a.get("mfu_with_lm_head")
            lines.append(f"| {a['arm']} | {a['tokens_per_s']:,.0f} | "
                         f"{'–' if lmh is None else format(lmh, '.1%')} | {a['mfu']:.1%} | "
                         f"{fmt(a.get('peak_mem_gib'), '.1f')} | "
                         f"{fmt(a.get('opt_step_ms_median'), '.2f')} "
                         f"({fmt(a.get('opt_step_floor_ms'), '.2f')}) | "
                         f"{fmt(a.get('opt_step_over_floor'), '.2f')} | "
                         f"{fmt(a.get('opt_clip_ms_median'), '.2f')} | "
                         f"{fmt(a.get('final_loss'), '.4f')} |")
        ratios = r.get("ratios") or {}
        if ratios:
            lines.append("")
            lines += [f"- {key.replace('_', ' ')}: {fmt(v, '.4f')}" for key, v in ratios.items()]
        lines.append("")
    return lines


def profile_section() -> list[str]:
    d = load("fp16_profile")
    if not d:
        return ["No kernel-level results yet."]
    c = d["config"]
    lines = [f"{d.get('gpu')}, torch {d.get('torch')}; shapes of the {d['preset']} preset "
             f"(batch {c['batch']}, seq {c['seq']}, {c['heads']} heads of "
             f"{c['hidden'] // c['heads']}, vocab {c['vocab']}). Command: "
             f"`python3 benchmarks/fp16_profile.py --preset {d['preset']} --parts "
             f"{','.join(k for k in ('attention', 'ce', 'adam', 'gelu', 'profile') if k in d)}` "
             "(each part may come from its own call).", ""]
    if "attention" in d:
        lines += ["Causal attention, fp16, forward + backward of one layer by SDPA backend:", "",
                  "| backend | fwd ms | fwd+bwd ms | per step (all layers) ms | rel. diff to flash |",
                  "|---|---|---|---|---|"]
        for name, r in d["attention"].items():
            if "error" in r:
                lines.append(f"| {name} | not available: {r['error']} | | | |")
            else:
                lines.append(f"| {name} | {r['fwd_ms']:.3f} | {r['fwd_bwd_ms']:.3f} | "
                             f"{r['per_step_ms']:.1f} | {r['rel_err_vs_flash']:.1e} |")
        lines.append("")
    if "ce" in d:
        r = d["ce"]
        lines += [f"Cross entropy of half logits [{c['batch'] * c['seq']}, {c['vocab']}], forward "
                  "+ backward with a loss scale of 65536:", "",
                  "| loss | fwd+bwd ms | extra peak GiB |", "|---|---|---|",
                  f"| F.cross_entropy(logits.float()) | {r['fp32']['fwd_bwd_ms']:.2f} | "
                  f"{r['fp32']['extra_peak_gib']:.2f} |",
                  f"| fused (fp16/fused_loss.py) | {r['fused']['fwd_bwd_ms']:.2f} | "
                  f"{r['fused']['extra_peak_gib']:.2f} |", "",
                  f"Loss difference {r['loss_diff']:.1e}, gradient relative difference "
                  f"{r['grad_rel_err']:.1e}; an inf logit gives loss {r['inf_logit_loss']}.", ""]
    if "adam" in d:
        r = d["adam"]
        lines += [f"Fused step kernels on one bucket of the preset model's own parameter shapes "
                  f"({r['numel'] / 1e6:.0f}M parameters in {r['tensors']} tensors, each "
                  f"gradient its own tensor as autograd leaves it); device-to-device copy "
                  f"{r['copy_tb_s']:.2f} TB/s, so the Adam step's 28 B/param floor is "
                  f"{r['floor_ms_at_copy_bw']:.2f} ms and the gradient norm's 2 B/param floor "
                  f"{r['floor_ms_at_copy_bw'] / 14:.2f} ms. torch's vector_norm over one flat "
                  f"fp16 buffer of that size: {r['torch_norm_ms']:.3f} ms. The fused path runs "
                  "Adam at BLOCK 1024 / 4 warps and the norm at BLOCK 2048 / 4 warps.", "",
                  "| BLOCK | num_warps | Adam ms | x floor | norm ms | x its floor |",
                  "|---|---|---|---|---|---|"]
        for v in r["variants"]:
            lines.append(f"| {v['block']} | {v['warps']} | {v['ms']:.3f} | {v['x_floor']:.3f} | "
                         f"{v['norm_ms']:.3f} | {v['norm_x_floor']:.3f} |")
        lines += ["", f"Host time (medians, warm, in a loop): one Adam launch through Triton's "
                  f"launcher {r['host_launch_us']:.0f} us, a whole FusedStepper.step() "
                  f"{r['host_step_us']:.0f} us (with, after the launch, the per-parameter "
                  "step-count update on CPU tensors: this inner AdamW is not fused=True).", ""]
    if "gelu" in d:
        r = d["gelu"]
        rows, cols = r["shape"]
        lines += [f"GELU on the MLP's [{rows}, {cols}] fp16 activation by torch's kernels; copy "
                  f"{r['copy_tb_s']:.2f} TB/s, floor {r['floor_fwd_ms']:.3f} ms forward (read x, "
                  f"write y), {r['floor_bwd_ms']:.3f} ms backward (read dy and x, write dx). "
                  "smp.nn's MLP uses the erf form.", "",
                  "| approximate | fwd ms | x floor | bwd ms | x floor |", "|---|---|---|---|---|"]
        for name, t in r["torch"].items():
            lines.append(f"| {name} | {t['fwd_ms']:.3f} | {t['fwd_ms'] / r['floor_fwd_ms']:.2f} | "
                         f"{t['bwd_ms']:.3f} | {t['bwd_ms'] / r['floor_bwd_ms']:.2f} |")
        lines.append("")
    return lines


def step_profile_section() -> list[str]:
    d = load("fp16_profile_step")
    if not d:
        return []
    cmds = d.get("commands", {})
    lines = [f"Where the 1.3B step's time goes ({d.get('gpu')}, torch {d.get('torch')}; "
             f"{d.get('note', '')}).", ""]
    if "attention_model" in d:
        lines += [f"Attention with q, k, v as the models hold them (views of one [b, s, 3h] "
                  f"projection), one layer: `{cmds.get('attention_model', '')}`.", "",
                  "| backend | fwd ms | fwd+bwd ms | per step (all layers) ms |", "|---|---|---|---|"]
        for name, r in d["attention_model"].items():
            if "error" not in r:
                lines.append(f"| {name} | {r['fwd_ms']:.3f} | {r['fwd_bwd_ms']:.3f} | "
                             f"{r['per_step_ms']:.1f} |")
        lines.append("")
    for arm in ("smp", "smp_nn"):
        r = d.get(f"profile_{arm}")
        if not r:
            continue
        # the profiler's user ranges (step*, Optimizer.step#..., opt.*) are not kernels
        ranges = sum(k["ms"] for k in r["top_kernels"] if k["calls"] <= 1 and (
            k["name"].startswith(("step", "opt.", "Optimizer.step"))))
        busy = r["gpu_busy_ms_per_step"] - ranges
        lines += [f"torch.profiler over 2 steps of the `{arm}` arm: "
                  f"`{cmds.get(f'profile_{arm}', '')}`. Wall {r['wall_ms_per_step']:.1f} ms a "
                  f"step, kernels {busy:.1f} ms, GPU idle gaps over 50 us "
                  f"{r['gpu_gap_total_ms_per_step']:.2f} ms (the host sync between the "
                  "gradient norm and the Adam launch).", "",
                  "| kernel | ms a step | launches a step |", "|---|---|---|"]
        for k in r["top_kernels"]:
            if k["name"].startswith(("step", "opt.", "Optimizer.step")):
                continue
            if k["ms"] < 0.8:
                break
            lines.append(f"| `{k['name'][:90]}` | {k['ms']:.2f} | {k['calls']} |")
        lines.append("")
    return lines


def gpu_docker_section() -> list[str]:
    d = load("gpu_docker")
    if not d:
        return ["No local_gpu results yet."]
    h = d["hyperparameters"]
    aws = load("gpu_docker_aws") or {}
    lines = [f"{d['device']} ({d.get('gpu_memory_gib')} GiB), torch {d['torch']} (CUDA "
             f"{d.get('cuda')}), {d.get('cpu_count')} CPUs. Command: `bash "
             "benchmarks/gpu_docker.sh` (engine from Debian's binaries, the GPU image from the "
             "machine's own CUDA PyTorch, then `benchmarks/gpu_docker.py --preset "
             f"{d['preset']} --steps {d['steps']} --kill-test`). GPUs reached through: "
             f"{d.get('gpu_access')}; job network: {d.get('network')}.", "",
             f"The seed's FP16 job (examples/gpt_fp16/train_gpt.py: {h['num_layers']} layers, "
             f"hidden {h['hidden']}, {h['heads']} heads, seq {h['seq_len']}, batch "
             f"{h['batch_size']}, vocab {h['vocab']}, lr {h['lr']}, dynamic loss scale from "
             f"{h['init_scale']:.0f}, clip 1.0), same seed in every run; tokens/s over steps "
             f"{d['warmup'] + 1}-{d['steps']}; first step = launch to the end of step 1.", "",
             "| launched by | first step s | wall s | tokens/s | loss: first -> last | "
             "skipped steps |", "|---|---|---|---|---|---|"]
    for mode, r in d["runs"].items():
        lines.append(f"| {mode} | {d['first_step_s'][mode]:.1f} | {d['wall_s'][mode]:.1f} | "
                     f"{d['tokens_per_s'][mode]:,.0f} | {r['loss'][0]:.4f} -> "
                     f"{r['loss'][-1]:.4f} | {sum(r['skipped'])} |")
    lines += ["", f"- local_gpu / local_process tokens/s: {d['ratio']:.4f}",
              f"- largest loss difference over {d['steps']} steps, local_gpu vs local_process: "
              f"{d['loss_max_abs_diff']:.2e} (torchrun vs local_process, the GPU's own "
              f"run-to-run noise: {fmt(d.get('loss_max_abs_diff_torchrun_vs_local_process'), '.2e')}"
              f"); loss scales equal: {fmt(d['scales_equal'])}, skipped steps equal: "
              f"{fmt(d['skipped_equal'])}"]
    for where, r in d.get("import_s", {}).items():
        lines.append(f"- import {'on the host' if where == 'host' else 'in the image'}: torch {r['torch_s']:.2f} s, torch + smp "
                     f"{r['smp_s']:.2f} s ({r['ratio']:.2f}x)")
    k = d.get("kill")
    if k:
        lines.append(f"- SIGKILL of the SDK during a local_gpu job ({k['gpu_bytes_in_use_at_kill'] / 2**30:.1f} "
                     f"GiB in use on the GPU): containers gone after {fmt(k['containers_gone_s'], '.2f')} s, "
                     f"the GPU's memory back after {fmt(k['gpu_memory_back_s'], '.2f')} s")
    if aws:
        j1, j2 = aws["job1"], aws["job2"]
        lines.append(f"- AWS's train_gpt_simple.py (unmodified, transformers 4.46.3 installed by "
                     f"the job's requirements.txt from carried wheels) through local_gpu: "
                     f"{j1['status']}, loss {j1['first_loss'][1]:.3f} -> "
                     f"{j1['last_loss'][1]:.3f} over {aws['steps']} steps with checkpoints "
                     f"every {aws['ckpt']}; resumed job {j2['status']} from step "
                     f"{j2['first_loss'][0]} ({j2['first_loss'][1]:.3f}) to "
                     f"{j2['last_loss'][0]} ({j2['last_loss'][1]:.3f}); model.tar.gz holds "
                     f"{', '.join(m for m in j1['model_tar_members'] if not m.startswith('('))}")
    return lines


def slurm_gpu_section() -> list[str]:
    d = load("slurm_gpu")
    if not d:
        return ["No Slurm GPU results yet."]
    sl, h = d["slurm"], d["hyperparameters"]
    seen = next(iter(d["runs"]["slurm"]["rank_env"].values()))
    lines = [f"{d['device']}, torch {d['torch']}; {sl['version']} (Debian 12's, carried with "
             "munge by container/slurm_bundle.sh), one node = this host: slurmctld and slurmd, "
             f"`{sl['gres']}`, {sl['task_plugin']} on {sl['cgroup_fs']} without systemd "
             f"(sinfo: {sl['sinfo']}). Command: `bash benchmarks/slurm_gpu_host.sh`.", "",
             f"The seed's FP16 job ({h['num_layers']} layers, hidden {h['hidden']}, seq "
             f"{h['seq_len']}, batch {h['batch_size']}, vocab {h['vocab']}, {h['steps']} steps) "
             f"through `fit(instance_type=\"slurm\", backend_options={d['slurm_backend_options']})`"
             " against the same job in local_process:", "",
             "| run | first step s | wall s | tokens/s | loss: first -> last | skipped |",
             "|---|---|---|---|---|---|"]
    for mode, r in d["runs"].items():
        lines.append(f"| {mode} | {r['first_step_s']:.1f} | {r['wall_s']:.1f} | "
                     f"{r['tokens_per_s']:,.0f} | {r['loss'][0]:.4f} -> {r['loss'][-1]:.4f} | "
                     f"{sum(r['skipped'])} |")
    lines += ["", f"- loss max abs diff {d['loss_max_abs_diff']:.2e}; loss scales equal: "
              f"{fmt(d['scales_equal'])}; skipped steps equal: {fmt(d['skipped_equal'])}; "
              f"tokens/s Slurm / local_process {d['ratio']:.3f} (one run each, Slurm first)",
              f"- what the rank saw under Slurm: CUDA_VISIBLE_DEVICES={seen['CUDA_VISIBLE_DEVICES']}"
              f", NCCL_SOCKET_IFNAME={seen['NCCL_SOCKET_IFNAME']}, {len(seen['affinity'])} of "
              f"{seen['cpu_count']} CPUs in its affinity, SLURM_CPUS_PER_TASK="
              f"{seen['SLURM'].get('SLURM_CPUS_PER_TASK')}, SLURM_JOB_GPUS="
              f"{seen['SLURM'].get('SLURM_JOB_GPUS')}"]
    return lines


def memory_section() -> list[str]:
    d = load("memory")
    if not d:
        return ["No memory results yet."]
    m, c = d["meta"], d["meta"]["config"]
    lines = [f"{m['gpu']} ({m['capacity_gib']:.1f} GiB), torch {m['torch']}; smp FP16 (dynamic "
             f"loss scaling, fused AdamW step, clip 1.0) on the GPT of fp16_gpu.py: hidden "
             f"{c['hidden']}, {c['heads']} heads, seq {c['seq']}, batch {c['batch']}, vocab "
             f"{c['vocab']}; one process per run. Static = allocated at a step's start (fp16 "
             "weights and grads, fp32 masters, Adam moments); activation = allocated at the end "
             "of forward minus static (what is kept for backward).", "",
             f"Command: `{m['command']}`.", "",
             f"{c['layers']} layers, {m['steps']} timed steps after {m['warmup']}:", "",
             "| arm | tokens/s | step ms | peak GiB | static GiB | activation GiB | "
             "host GiB (offloaded) | final loss |", "|---|---|---|---|---|---|---|---|"]
    for r in d["arms"]:
        if "failed" in r or r.get("oom"):
            lines.append(f"| {r['arm']} | {r.get('failed') or 'out of memory'} | | | | | | |")
            continue
        lines.append(f"| {r['arm']} | {r['tokens_per_s']:,.0f} | {r['step_ms']:.1f} | "
                     f"{r['peak_gib']:.1f} | {r['static_gib']:.1f} | {r['activation_gib']:.2f} | "
                     f"{r['peak_host_gib']:.2f} | {r['final_loss']:.4f} |")
    if d.get("largest"):
        lines += ["", "Largest model (the same layer stacked deeper; the deepest that ran 3 "
                  "steps, the next layer out of memory):", "",
                  "| arm | layers | parameters | peak GiB | GiB per layer | tokens/s | "
                  "next layer OOM |", "|---|---|---|---|---|---|---|"]
        for r in d["largest"]:
            if not r.get("largest_layers"):
                lines.append(f"| {r['arm']} | {r.get('note', 'not found')} | | | | | |")
                continue
            lines.append(f"| {r['arm']} | {r['largest_layers']} | "
                         f"{r['largest_params'] / 1e9:.2f}B | {r['largest_peak_gib']:.1f} | "
                         f"{r['gib_per_layer']:.3f} | {r['largest_tokens_per_s']:,.0f} | "
                         f"{'yes' if r['next_layer_oom'] else 'not shown'} |")
    lines += ["", *[f"- {k.replace('_', ' ')}: {fmt(v, '.3f')}" for k, v in d["ratios"].items()]]
    return lines


def multi_gpu_section() -> list[str]:
    lines = []
    for name in ("multi_gpu", "multi_gpu_dry_run_cpu", "multi_gpu_dry_run_gpu"):
        d = load(name)
        if not d:
            continue
        m = d["meta"]
        lines += [f"### {name}.json: {m.get('machine') or m.get('gpu')}, {m['gpus']} GPU(s), "
                  f"torch {m['torch']}", "", f"Command: `{m['command']}`; all checks ok: "
                  f"{m.get('all_ok')}.", ""]
        if d.get("correctness"):
            lines += ["| job | world | backend | max rel. loss diff | overflow agreed | "
                      "skipped steps | ok |", "|---|---|---|---|---|---|---|"]
            for r in d["correctness"]:
                job, chk = r["job"], r.get("check") or {}
                skipped = ",".join(str(i + chk.get("from_step", 0))
                                   for i, f in enumerate(chk.get("skipped", [])) if f)
                lines.append(f"| {r['name']} | {job.get('world', '–')} | "
                             f"{job.get('backend', '–')} | "
                             f"{fmt(chk.get('max_rel_loss_diff'), '.1e')} | "
                             f"{fmt(chk.get('overflow_agreed_every_rank'))} | "
                             f"{skipped or ('–' if not chk else 'none')} | "
                             f"{fmt(chk.get('ok')) if chk else 'reference / save'} |")
            lines.append("")
        if d.get("scaling"):
            lines += ["| job | world | tokens/s | per GPU / one GPU | MFU | target |",
                      "|---|---|---|---|---|---|"]
            for r in d["scaling"]:
                job = r["job"]
                lines.append(f"| {r['name']} | {job.get('world', '–')} | "
                             f"{fmt(job.get('tokens_per_s'), ',.0f')} | "
                             f"{fmt(r.get('per_gpu_over_one_gpu'), '.3f')} | "
                             f"{fmt(job.get('mfu'), '.1%')} | "
                             f"{fmt(r.get('target'))} |")
            lines.append("")
    return lines or ["No multi-GPU results yet."]
