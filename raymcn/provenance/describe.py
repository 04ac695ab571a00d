"""A record's entries in words: the one-line labels the tables, the console and the trackers show, the
facets a resume compares, and the trackers' own forms (MLflow's tags under MLflow's names, a flat
dict for W&B's config, Markdown for TensorBoard's text and MLflow's note)."""

from __future__ import annotations

from typing import Any

from raymcn.provenance.record import all_nodes, drivers

NO_GIT = "none (no git checkout)"
CPU_BUILD = "none (CPU build)"
MANIFEST_FACET = "shards' manifest"
NODE_FACETS = ("raymcn sources", "Python", "torch", "torch's CUDA", "Ray")  # what the nodes of one run must share


def size_text(n: int | None) -> str:
    if n is None:
        return "?"
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


# --- labels ---------------------------------------------------------------------------------------------
def changes_text(code: dict[str, Any]) -> str:
    """``none``, or the patch of the uncommitted changes by its digest and files."""
    if not code.get("dirty"):
        return "none"
    files = len(code.get("patch_files") or [])
    return f"patch {str(code.get('patch_sha256', ''))[:8]}, {files} file{'s' if files != 1 else ''}"


def code_label(code: dict[str, Any]) -> str:
    """``commit 65b04ba``, ``commit 65b04ba with uncommitted changes (patch 1a2b3c4d, 2 files)``, or
    without git ``raymcn 0.1.0, sources 9f8e7d6c5b4a (no git checkout)``; a run whose commit was carried
    from its sweep's driver but whose own sources differ says so."""
    sources = str(code.get("source_digest", ""))[:12]
    if not code.get("commit"):
        return f"raymcn {code.get('version', '?')}, sources {sources} (no git checkout)"
    label = f"commit {code['commit'][:7]}"
    if code.get("dirty"):
        label += f" with uncommitted changes ({changes_text(code)})"
    carried = code.get("carried_source_digest")
    if carried and carried != code.get("source_digest"):
        label += f", run from other sources ({sources}) than that checkout's"
    return label


def environment_label(env: dict[str, Any]) -> str:
    cuda = env.get("cuda")
    return (f"Python {env.get('python', '?')}, torch {env.get('torch', '?')} "
            f"({'CUDA ' + cuda if cuda else 'CPU build'}), Ray {env.get('ray', '?')}, numpy {env.get('numpy', '?')}")


def gpus_text(gpus: list[str], driver: str | None) -> str:
    if not gpus:
        return "no GPU"
    models = {m: gpus.count(m) for m in dict.fromkeys(gpus)}
    return ", ".join(f"{n}x {m}" for m, n in models.items()) + (f", driver {driver}" if driver else "")


def host_label(name: str, gpus: list[str], driver: str | None) -> str:
    return f"{name} ({gpus_text(gpus, driver)})"


def _file(identity: dict[str, Any]) -> str:
    if identity.get("missing"):
        return "missing"
    whole = identity.get("digest_of", "the whole file") == "the whole file"
    return (f"{size_text(identity.get('bytes'))}, sha256 {str(identity.get('sha256', ''))[:12]}"
            + ("" if whole else f" of {identity['digest_of']}"))


def data_facets(data: dict[str, Any]) -> dict[str, str]:
    """The data's identity, facet by facet (each compared on a resume)."""
    out = {}
    if synthetic := data.get("synthetic"):
        out["synthetic corpus"] = ", ".join(f"{k} {v}" for k, v in synthetic.items())
    if shards := data.get("shards"):
        out["shards"] = str(shards.get("dir", ""))
        manifest = shards.get("manifest") or {}
        out[MANIFEST_FACET] = (f"sha256 {str(manifest.get('sha256', ''))[:12]} ({shards.get('shards', '?')} shards, "
                                   f"{shards.get('videos', '?')} videos)")
    if evalset := data.get("eval_set"):
        out["eval set"] = f"{evalset.get('spec', '')} ({_file(evalset.get('file') or {})})"
    if words := data.get("word_vectors"):
        out["word vectors"] = f"{words['path']} ({_file(words)})" if words.get("path") else words.get("from", "")
    return out


def data_label(data: dict[str, Any]) -> str:
    """The data in one line: the corpus (synthetic with its settings, or the shards), the manifest's
    digest and counts, and (the lab's data) the eval set and the word vectors by size and digest."""
    facets = data_facets(data)
    manifest = facets.get(MANIFEST_FACET, "?")
    if "synthetic corpus" in facets:
        return f"the synthetic corpus ({facets['synthetic corpus']}), manifest {manifest}"
    parts = [f"shards {facets['shards']} (manifest {manifest})"] if "shards" in facets else []
    parts += [f"eval set {facets['eval set']}"] if "eval set" in facets else []
    parts += [f"word vectors {facets['word vectors']}"] if facets.get("word vectors") else []
    return "; ".join(parts) or "not recorded"


# --- facets: what a resume compares ------------------------------------------------------------------------
def facets(entry: dict[str, Any]) -> dict[str, str]:
    """A driver entry as facet -> short value: the code, the environment, the host, the data, the seeds."""
    code, env = entry.get("code") or {}, entry.get("environment") or {}
    host = entry.get("host") or {}
    return {"commit": code["commit"][:7] if code.get("commit") else NO_GIT,
            "uncommitted changes": changes_text(code), "raymcn sources": str(code.get("source_digest", ""))[:12],
            "raymcn": str(code.get("version", "?")), "Python": str(env.get("python")), "torch": str(env.get("torch")),
            "torch's CUDA": env.get("cuda") or CPU_BUILD, "Ray": str(env.get("ray")), "numpy": str(env.get("numpy")),
            "host": str(host.get("name")), "GPUs": gpus_text(host.get("gpus") or [], host.get("gpu_driver")),
            **data_facets(entry.get("data") or {}),
            **{key: str(value) for key, value in (entry.get("seeds") or {}).items()}}


def node_facets(node: dict[str, Any]) -> dict[str, str]:
    """What the nodes of one run must share (:data:`NODE_FACETS`), of a ``nodes`` entry's node."""
    return {"raymcn sources": str(node.get("source_digest", ""))[:12], "Python": str(node.get("python")),
            "torch": str(node.get("torch")), "torch's CUDA": node.get("cuda") or CPU_BUILD, "Ray": str(node.get("ray"))}


def package_changes(old: dict[str, str], new: dict[str, str], shown: int = 5) -> str:
    """``3 changed: foo 1.0 -> 1.1, bar added (2.0), baz removed``, the key packages left out (their
    own facets say them); "" when none changed."""
    skip = {"torch", "ray", "numpy", "raymcn"}
    changed = [k for k in sorted(set(old) | set(new)) if k not in skip and old.get(k) != new.get(k)]
    if not changed:
        return ""
    words = [f"{k} added ({new[k]})" if k not in old else f"{k} removed" if k not in new else f"{k} {old[k]} -> {new[k]}"
             for k in changed[:shown]]
    more = f" and {len(changed) - shown} more" if len(changed) > shown else ""
    return f"{len(changed)} changed: {', '.join(words)}{more}"


# --- the trackers' forms -------------------------------------------------------------------------------
def summary(entries: list[dict[str, Any]]) -> dict[str, str]:
    """The newest driver entry's code, environment, hosts (those of its ranks, else the driver's) and
    data, one line each; {} without a driver entry."""
    found = drivers(entries)
    if not found:
        return {}
    latest = found[-1]
    nodes = all_nodes(entries) or [{"host": (latest.get("host") or {}).get("name"), **(latest.get("host") or {})}]
    hosts = list(dict.fromkeys(host_label(str(n.get("host")), n.get("gpus") or [], n.get("gpu_driver")) for n in nodes))
    return {"code": code_label(latest.get("code") or {}), "environment": environment_label(latest.get("environment") or {}),
            "hosts": ", ".join(hosts), "data": data_label(latest.get("data") or {}),
            "seeds": ", ".join(f"{k}={v}" for k, v in (latest.get("seeds") or {}).items()),
            "command": " ".join(latest.get("command") or []), "started": str(found[0].get("time", ""))}


def markdown(entries: list[dict[str, Any]], where: str) -> str:
    """The record in a few Markdown lines (TensorBoard's text plugin, MLflow's run description)."""
    lines = [f"- **{k}**: {v}" for k, v in summary(entries).items() if v]
    resumed = len(drivers(entries)) - 1
    if resumed > 0:
        lines.append(f"- **resumed**: {resumed} time(s); each entry of the record says with what")
    return "\n".join([f"What made this run's numbers (the record: `{where}`):", "", *lines])


def mlflow_tags(entries: list[dict[str, Any]], where: str) -> dict[str, str]:
    """MLflow's own tags where MLflow has one (``mlflow.source.git.commit``, ``mlflow.source.git.branch``,
    ``mlflow.source.git.repoURL``, ``mlflow.source.name``, ``mlflow.source.type``, ``mlflow.user``,
    ``mlflow.note.content``), the rest as ``raymcn.*``: from the newest driver entry."""
    found = drivers(entries)
    if not found:
        return {}
    latest = found[-1]
    code, env, host = latest.get("code") or {}, latest.get("environment") or {}, latest.get("host") or {}
    said = summary(entries)
    tags = {"mlflow.source.type": "LOCAL", "mlflow.source.name": said["command"][:500],
            "mlflow.user": str(host.get("user", "")), "mlflow.note.content": markdown(entries, where)[:5000],
            "raymcn.code": said["code"], "raymcn.uncommitted_changes": changes_text(code),
            "raymcn.sources": str(code.get("source_digest", "")), "raymcn.version": str(code.get("version", "")),
            "raymcn.environment": said["environment"], "raymcn.hosts": said["hosts"][:5000],
            "raymcn.data": said["data"][:5000], "raymcn.seeds": said["seeds"], "raymcn.record": where,
            **{f"raymcn.{k}": str(env.get(k)) for k in ("python", "torch", "cuda", "ray", "numpy")}}
    if code.get("commit"):
        tags["mlflow.source.git.commit"] = code["commit"]
        if code.get("branch"):
            tags["mlflow.source.git.branch"] = code["branch"]
        if code.get("repository"):
            tags["mlflow.source.git.repoURL"] = code["repository"]
    return tags


def flat(entries: list[dict[str, Any]]) -> dict[str, str]:
    """The summary under ``provenance/`` keys, with the commit and the patch's digest (W&B's config)."""
    found = drivers(entries)
    code = (found[-1].get("code") or {}) if found else {}
    return {f"provenance/{k}": v for k, v in {**summary(entries), "commit": code.get("commit") or "",
                                                "patch_sha256": code.get("patch_sha256") or ""}.items()}
