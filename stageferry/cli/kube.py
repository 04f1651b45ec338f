"""``stageferry kube``: the Kubernetes manifests that follow from the pipeline file (docs/kubernetes.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from stageferry.cli.app import _App, _expected_errors, _settings, app
from stageferry.config import PipelineConfig
from stageferry.errors import ConfigError

kube_app = _App(
    name="kube",
    help="Kubernetes manifests from the pipeline file: generate the per-stage kustomize files, make the Secret.",
    no_args_is_help=True,
    rich_markup_mode=None,
)
app.add_typer(kube_app, name="kube")

_DEFAULT_ROOT = Path("deploy/kubernetes")
RootOpt = Annotated[
    Path, typer.Option("--root", metavar="DIR", help="The kustomize tree (base/, overlays/, components/).")
]
ValuesOpt = Annotated[
    Path | None,
    typer.Option("--values", metavar="FILE", help="Replicas, autoscaling, resources; default: DIR/values.toml."),
]


def _require_yaml() -> None:
    """The manifests are YAML: without PyYAML (the ``kube`` extra) say so in one line, not a traceback."""
    try:
        import yaml  # noqa: F401
    except ImportError:
        raise ConfigError("stageferry kube needs PyYAML: pip install 'stageferry[kube]'") from None


def _values_path(root: Path, values: Path | None) -> Path | None:
    if values is not None:
        return values
    default = root / "values.toml"
    return default if default.exists() else None


@kube_app.command()
@_expected_errors
def generate(
    ctx: typer.Context,
    root: RootOpt = _DEFAULT_ROOT,
    values: ValuesOpt = None,
    check: Annotated[bool, typer.Option("--check", help="Write nothing; exit 1 if a generated file is stale.")] = False,
) -> None:
    """Write the per-stage files under DIR from the pipeline file (--pipeline; default DIR/base/pipeline.toml):
    each stage's Deployment, PodDisruptionBudget, KEDA ScaledObject and the CPU and GPU profiles' patches."""
    _require_yaml()
    from stageferry.kube.generate import generated_files, stale, write

    pipeline = _settings(ctx).pipeline or root / "base" / "pipeline.toml"
    if not pipeline.exists():
        raise ConfigError(f"no pipeline file at {pipeline}", path=str(pipeline))
    files = generated_files(pipeline, _values_path(root, values))
    if check:
        old = stale(root, files)
        for rel in old:
            typer.echo(f"stale: {root / rel}", err=True)
        raise typer.Exit(1 if old else 0)
    for rel in write(root, files):
        typer.echo(str(root / rel))


@kube_app.command()
@_expected_errors
def secret(
    ctx: typer.Context,
    root: RootOpt = _DEFAULT_ROOT,
    values: ValuesOpt = None,
    url: Annotated[
        str | None,
        typer.Option("--url", metavar="URL", help="An existing Redis (with components/external-redis)."),
    ] = None,
    tls: Annotated[bool, typer.Option("--tls", help="rediss:// with the CA of components/redis-tls.")] = False,
    sentinel: Annotated[
        bool,
        typer.Option(
            "--sentinel",
            help="For components/redis-ha: the URL via its sentinels, the replicas' and sentinels' users.",
        ),
    ] = False,
    namespace: Annotated[
        str,
        typer.Option(
            "--namespace",
            help="The namespace the deployment runs in: KEDA's operator dials Redis from its own, by this name.",
        ),
    ] = "stageferry",
) -> None:
    """Print the Secret stageferry-redis (kubectl apply -f -): the Redis ACL file (`stageferry acl --scaler`)
    with fresh passwords, the services' URL, the autoscaler's and the clients' passwords."""
    _require_yaml()
    from stageferry.kube.generate import redis_secret, secret_yaml
    from stageferry.kube.values import Values

    settings = _settings(ctx)
    pipeline = PipelineConfig.load(settings.pipeline or root / "base" / "pipeline.toml")
    vals = Values.load(_values_path(root, values))
    secret = redis_secret(pipeline, vals, url=url, tls=tls, sentinel=sentinel, namespace=namespace)
    typer.echo(secret_yaml(secret), nl=False)
