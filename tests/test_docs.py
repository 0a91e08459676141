"""The README's records table against the logs it links and the FLOPs today's code counts, and every link in the
docs against the repository: a number typed by hand or a log renamed fails here. And every command-line option
documented in --help."""
import ast
import json
import os
import re

import pytest
import torch

import core
import train_cifar

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md", "RESULTS.md", "SPEED.md"]
RENAMED = {"fast94-sgd": "fast94"}  # fast94-sgd was fast94 until the Muon recipe took the name; its logs keep it


def read(name):
    with open(os.path.join(ROOT, name), encoding="utf-8") as f:
        return f.read()


def anchors(markdown):
    """GitHub's anchors of a document's headings."""
    return {re.sub(r"[^a-z0-9 -]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            for line in markdown.splitlines() if line.startswith("#")}


def records_rows():
    """(preset, cells) of each row of the README's records table."""
    lines = read("README.md").splitlines()
    start = lines.index("### Records measured here")
    rows = []
    for line in lines[start + 1:]:
        if rows and not line.startswith("|"):
            break
        if line.startswith("| `"):
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            rows.append((cells[0].split("`")[1], cells))
    return rows


def linked_logs(cell):
    return [json.loads(read(path)) for path in re.findall(r"\]\((logs/[^)]+\.json)\)", cell)]


def run_accuracy(run):
    """A finished run's final accuracy, or a run stopped early's last evaluation."""
    return run["accuracy"] if run["accuracy"] is not None else run["epochs"][-1]["test_acc"]


def counted_pf(preset):
    """A preset's training FLOPs per run (PF) as today's code counts them: on shapes alone (the meta device)."""
    meta = torch.device("meta")
    cfg = train_cifar.make_config(preset, precision="fp32")
    net = train_cifar.build_model(cfg, meta)
    return train_cifar.run_flops(cfg, net, train_cifar.make_optimizer(cfg, net), meta, "fp32", 50000)[2] / 1e15


def flops_per_run(log):
    return log.get("train_flops_per_run") or log["train_flops_per_step"] * log["train_steps"]


@pytest.mark.parametrize("doc", DOCS)
def test_every_link_resolves(doc):
    text = read(doc)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://")):
            continue
        path, _, anchor = target.partition("#")
        if path:
            assert os.path.exists(os.path.join(ROOT, path)), f"{doc} links to a missing {path}"
        if anchor:
            assert anchor in (anchors(read(path)) if path else anchors(text)), f"{doc}: no heading for #{anchor}"
        elif not path:
            pytest.fail(f"{doc}: empty link")


def test_records_table_lists_the_main_presets():
    presets = [p for p, _ in records_rows()]
    for preset in ("fast94", "fast95", "fast96", "resnet9-tricks", "resnet9", "resnet18"):
        assert preset in presets


@pytest.mark.parametrize("preset,cells", records_rows(), ids=[p for p, _ in records_rows()])
def test_records_row_matches_its_logs(preset, cells):
    _, accuracy_cell, _, hardware_cell, flops_cell, log_cell = cells
    logs = linked_logs(log_cell)
    assert logs, f"{preset}: the row links no log"
    assert all(log["preset"] == RENAMED.get(preset, preset) for log in logs), f"{preset}: a linked log is of another preset"
    runs = [run for log in logs for run in log["runs"]]
    accuracies = [100 * run_accuracy(run) for run in runs]
    # "M ± S% (n=K)" and "M ± S% over n=K": the mean and sample std of the first K runs in link order;
    # a lone "M% (n=1" is the first run's accuracy
    stats = re.findall(r"([\d.]+) ± ([\d.]+)%\*{0,2} (?:\(n=|over n=)(\d+)", accuracy_cell)
    for mean, std, n in stats:
        assert int(n) <= len(accuracies), f"{preset}: n={n} but the logs hold {len(accuracies)} runs"
        m, s = core.mean_std(accuracies[:int(n)])
        assert (f"{m:.2f}", f"{s:.2f}") == (mean, std), f"{preset}: logs give {m:.2f} ± {s:.2f} for n={n}"
    if not stats:
        first = re.search(r"([\d.]+)%", accuracy_cell).group(1)
        assert f"{accuracies[0]:.2f}" == first, f"{preset}: its log gives {accuracies[0]:.2f}%"
    def shown(pf):
        return f"{pf:.3f} PF" in flops_cell or f"{pf:.2f} PF" in flops_cell
    today, logged = counted_pf(preset), flops_per_run(logs[0]) / 1e15
    assert shown(today), f"{preset}: today's code counts {today:.3f} PF a run"
    assert shown(logged) or f"{logged:.3f}" == f"{today:.3f}", f"{preset}: its log counts {logged:.3f} PF; say so too"
    # the cell names each vendor whose machines ran the linked logs, and no other
    def vendors(text):
        return {v for v in ("Intel", "AMD", "NVIDIA", "Apple") if v in text}
    logged = set().union(*(vendors(log["hardware"]) for log in logs))
    assert vendors(hardware_cell) == logged, f"{preset}: the logs ran on {sorted(logged)}, the row names {hardware_cell}"


CLI_SCRIPTS = ["train_cifar.py", "compare_runs.py", "plot_runs.py", "study_batch_size.py", "study_data_echo.py",
               *[os.path.join("benchmarks", f) for f in sorted(os.listdir(os.path.join(ROOT, "benchmarks")))
                 if f.endswith(".py")]]


@pytest.mark.parametrize("script", CLI_SCRIPTS)
def test_every_command_line_option_says_what_it_is(script):
    """Every add_argument of every script has a help text (train_cifar's generated options: test_train.py)."""
    tree = ast.parse(open(os.path.join(ROOT, script)).read())
    calls = [node for node in ast.walk(tree)
             if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument"]
    assert calls
    def says_something(call):
        """A help text given, and not one that says nothing: an empty or blank string, or argparse.SUPPRESS
        (which hides the option from --help)."""
        helps = [k.value for k in call.keywords if k.arg == "help"]
        if not helps:
            return False
        value = helps[0]
        if isinstance(value, ast.Constant):
            return isinstance(value.value, str) and value.value.strip() != ""
        return not (isinstance(value, ast.Attribute) and value.attr == "SUPPRESS")
    silent = [ast.unparse(c)[:80] for c in calls if not says_something(c)]
    assert not silent, silent
