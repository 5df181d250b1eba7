"""Plugin-owned settings: ``[plugins.NAME]`` tables validated by the model each plugin registered;
old key names as aliases."""

from __future__ import annotations

import json
import os

import pytest

from tierserve.cli.main import main
from tierserve.settings.config import Settings, load_settings
from tierserve.core.errors import ConfigError
from tierserve.core.plugins import load_plugins
from tierserve.plugins.backends.native import NativeBackend, NativeSettings
from tierserve.plugins.speculation.draft_model import DraftModelSettings
from tierserve.plugins.speculation.ngram import NgramSettings
from tests.engine_helpers import build_checkpoint

pytestmark = pytest.mark.unit

ECHO_PLUGIN = """
from pydantic import BaseModel, ConfigDict, Field
from tierserve.plugin_api import Proposal, Speculator, hookimpl

class EchoSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    depth: int = Field(2, ge=1, description="tokens echoed")
    greeting: str = "hi"

class EchoSpeculator(Speculator):
    def __init__(self, settings, target):
        super().__init__(settings, target)
        self.options = settings.plugin_options("echo", EchoSettings)

    def propose(self, requests):
        return [Proposal(list(r.token_ids[-self.options.depth:])[: r.num_tokens]) for r in requests]

@hookimpl
def register_speculators(register):
    register("echo", EchoSpeculator, settings=EchoSettings, aliases={"speculative.echo_depth": "depth"})
"""


def load(path=None, environ=None, overrides=None, preset=None):
    return load_settings(preset, config_file=path, environ=environ or {}, overrides=overrides)


def error_of(*args, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        load(*args, **kwargs)
    return str(info.value)


# ---- [plugins.NAME] tables ----------------------------------------------------------------------


def test_plugin_table_is_validated_by_its_model_naming_key_value_and_source(toml_file):
    path = toml_file("[plugins.ngram]\nmax_n = 0\n")
    message = error_of(path)
    assert f"plugins.ngram.max_n = 0 (from config file {path})" in message
    assert "greater than or equal to 1" in message

    message = error_of(environ={"TIERSERVE_PLUGINS__NGRAM__MAX_N": "many"})
    assert "plugins.ngram.max_n = 'many' (from environment variable TIERSERVE_PLUGINS__NGRAM__MAX_N)" in message
    assert "valid integer" in message


def test_plugin_table_from_every_source(toml_file):
    path = toml_file("[plugins.ngram]\nmin_n = 2\nmax_n = 9\n")
    loaded = load(path, environ={"TIERSERVE_PLUGINS__NGRAM__MAX_N": "7"}, overrides={("plugins.ngram", "min_n"): 3})
    options = loaded.settings.plugin_options("ngram", NgramSettings)
    assert (options.min_n, options.max_n) == (3, 7)
    assert loaded.source_of("plugins.ngram", "min_n") == "command line"
    assert loaded.source_of("plugins.ngram", "max_n") == "environment variable TIERSERVE_PLUGINS__NGRAM__MAX_N"


def test_a_rule_across_keys_lives_in_the_plugin_model(toml_file):
    path = toml_file("[plugins.ngram]\nmin_n = 5\nmax_n = 2\n")
    message = error_of(path)
    assert "[plugins.ngram]" in message and str(path) in message
    assert "min_n (5) must not exceed max_n (2)" in message


def test_unknown_plugin_table_names_the_components_that_declare_settings(toml_file):
    path = toml_file("[plugins.ngarm]\nmax_n = 3\n")
    message = error_of(path)
    assert f"unknown plugin table [plugins.ngarm] in config file {path}" in message
    assert "components with settings: draft_model, medusa, native, ngram, ngram_tree" in message
    assert "did you mean 'ngram'?" in message
    message = error_of(toml_file("[plugins.disk]\npath = '/tmp/x'\n", "disk.toml"))
    assert "[[kv_cache.tiers]] entry (plugin = 'disk')" in message


def test_unknown_key_in_a_plugin_table_lists_the_model_keys(toml_file):
    path = toml_file("[plugins.ngram]\nmaxn = 3\n")
    message = error_of(path)
    assert f"unknown key plugins.ngram.maxn in config file {path}" in message
    assert "keys of [plugins.ngram]: min_n, max_n; did you mean 'max_n'?" in message


def test_enabled_allowlist_and_plugin_tables_share_the_section(toml_file):
    path = toml_file("[plugins]\nenabled = []\n[plugins.ngram]\nmax_n = 6\n")
    settings = load(path).settings
    assert settings.plugins.enabled == []
    assert settings.plugin_options("ngram", NgramSettings).max_n == 6
    assert "enabled = 3" in error_of(toml_file("[plugins]\nenabled = 3\n", "bad.toml"))


def test_plugin_options_on_settings_built_directly():
    assert Settings().plugin_options("ngram", NgramSettings).max_n == 4
    assert Settings(plugins={"ngram": {"max_n": 6}}).plugin_options("ngram", NgramSettings).max_n == 6
    with pytest.raises(ConfigError, match=r"plugins\.ngram\.max_n = 0 \(from the Settings object\)"):
        Settings(plugins={"ngram": {"max_n": 0}}).plugin_options("ngram", NgramSettings)


# ---- the built-in knobs that moved, and their old names ---------------------------------------


def test_old_keys_still_work_and_say_which_alias_they_came_through(toml_file):
    path = toml_file(
        """
        [speculative]
        ngram_min = 2
        draft_model = "builtin:tiny"
        [model]
        linear_kernel = "torch"
        """
    )
    loaded = load(path, environ={"TIERSERVE_SPECULATIVE__NGRAM_MAX": "3"})
    settings = loaded.settings
    assert settings.plugin_options("ngram", NgramSettings).model_dump() == {"min_n": 2, "max_n": 3}
    assert settings.plugin_options("draft_model", DraftModelSettings).path == "builtin:tiny"
    assert settings.plugin_options("native", NativeSettings).linear_kernel == "torch"
    assert loaded.source_of("plugins.ngram", "min_n") == f"config file {path}, as speculative.ngram_min"
    assert loaded.source_of("plugins.ngram", "max_n") == (
        "environment variable TIERSERVE_SPECULATIVE__NGRAM_MAX, as speculative.ngram_max"
    )
    shown = loaded.explain()
    assert shown["plugins.native"]["linear_kernel"] == {
        "value": "torch",
        "source": f"config file {path}, as model.linear_kernel",
    }
    assert "ngram_min" not in shown["speculative"] and "linear_kernel" not in shown["model"]


def test_errors_through_an_alias_name_the_alias(toml_file):
    path = toml_file("[speculative]\nngram_min = 0\n")
    assert f"plugins.ngram.min_n = 0 (from config file {path}, as speculative.ngram_min)" in error_of(path)
    message = error_of(overrides={("speculative", "ngram_min"): 5})
    assert "[plugins.ngram] (from command line, as speculative.ngram_min)" in message
    assert "min_n (5) must not exceed max_n (4)" in message


def test_an_alias_and_its_new_key_in_one_layer_is_an_error(toml_file):
    path = toml_file("[speculative]\nngram_min = 2\n[plugins.ngram]\nmin_n = 3\n")
    message = error_of(path)
    assert "speculative.ngram_min" in message and "plugins.ngram.min_n" in message and str(path) in message
    environ = {"TIERSERVE_MODEL__LINEAR_KERNEL": "torch", "TIERSERVE_PLUGINS__NATIVE__LINEAR_KERNEL": "auto"}
    message = error_of(environ=environ)
    assert "TIERSERVE_MODEL__LINEAR_KERNEL" in message and "TIERSERVE_PLUGINS__NATIVE__LINEAR_KERNEL" in message
    # in different layers the later one wins, as for any key
    old = toml_file("[speculative]\nngram_min = 2\n", "old.toml")
    loaded = load(path=old, overrides={("plugins.ngram", "min_n"): 3})
    assert loaded.settings.plugin_options("ngram", NgramSettings).min_n == 3


def test_native_backend_reads_its_kernel_from_its_own_table_under_either_name(tmp_path):
    path = str(build_checkpoint(tmp_path, "m", "llama"))
    model = {("model", "path"): path, ("model", "device"): "cpu"}
    old = NativeBackend(load(overrides=model | {("model", "linear_kernel"): "torch"}).settings)
    new = NativeBackend(load(overrides=model | {("plugins.native", "linear_kernel"): "torch"}).settings)
    auto = NativeBackend(load(overrides=model).settings)
    assert (old.model.linear_kernel, new.model.linear_kernel) == ("torch", "torch")
    # the kernel is part of the fingerprint: KV of one kernel is never served to the other
    assert old.fingerprint == new.fingerprint
    assert (auto.fingerprint == new.fingerprint) == (auto.model.linear_kernel == "torch")


# ---- an outside plugin with its own settings ----------------------------------------------------


def test_outside_plugin_settings_are_validated_shown_and_read(install_fake_plugin, toml_file, capsys, monkeypatch):
    install_fake_plugin("tierserve-echo", "tierserve_echo_settings", ECHO_PLUGIN)
    for name in [n for n in os.environ if n.startswith("TIERSERVE_")]:
        monkeypatch.delenv(name)
    bad = toml_file("[plugins.echo]\ndepth = 0\n", "bad.toml")
    assert f"plugins.echo.depth = 0 (from config file {bad})" in error_of(bad)
    assert "keys of [plugins.echo]: depth, greeting" in error_of(toml_file("[plugins.echo]\ndeep = 1\n", "typo.toml"))

    good = toml_file('[speculative]\nmethod = "echo"\necho_depth = 5\n', "good.toml")
    loaded = load(good)
    echo = loaded.plugins.registry("speculators").get("echo").factory(loaded.settings, None)
    assert (echo.options.depth, echo.options.greeting) == (5, "hi")

    assert main(["config", "show", "--json", "--config", str(good)]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["plugins.echo"] == {
        "depth": {"value": 5, "source": f"config file {good}, as speculative.echo_depth"},
        "greeting": {"value": "hi", "source": "default"},
    }
    assert main(["config", "show", "--config", str(good)]) == 0
    text = capsys.readouterr().out
    assert "[plugins.echo]\ndepth    = 5    # config file" in text
    assert main(["plugins", "--json"]) == 0
    listed = {p["name"]: p for p in json.loads(capsys.readouterr().out)["plugins"]}
    assert listed["tierserve-echo"]["settings"] == {"echo": ["depth", "greeting"]}
    assert listed["tierserve.plugins.speculation.ngram"]["settings"] == {"ngram": ["min_n", "max_n"]}


def test_one_table_claimed_by_two_components_fails_the_second_plugin_naming_both(install_fake_plugin):
    install_fake_plugin("tierserve-echo", "tierserve_echo_claim", ECHO_PLUGIN)
    install_fake_plugin(
        "tierserve-zz-echo-backend",
        "tierserve_zz_echo_backend",
        """
        from pydantic import BaseModel
        from tierserve.core import hookimpl
        class Options(BaseModel):
            size: int = 1
        @hookimpl
        def register_backends(register):
            register("echo", object, settings=Options)
        """,
    )
    manager = load_plugins(allowlist=None)
    [failure] = manager.failures
    assert failure.name == "tierserve-zz-echo-backend"
    assert "[plugins.echo] is claimed twice" in failure.error
    assert "'tierserve-echo'" in failure.error and "'tierserve-zz-echo-backend'" in failure.error
    assert manager.settings_components()["echo"].plugin == "tierserve-echo"


ALIAS_PLUGIN = """
from pydantic import BaseModel
from tierserve.core import hookimpl
class Options(BaseModel):
    n: int = 1
@hookimpl
def register_speculators(register):
    register("{name}", object, settings=Options, aliases={{"{alias}": "n"}})
"""


@pytest.mark.parametrize(
    ("alias", "expected"),
    [
        ("speculative.ngram_min", "alias speculative.ngram_min is claimed twice: by 'ngram' of plugin "
         "'tierserve.plugins.speculation.ngram' and by 'steal' of plugin 'tierserve-aliases'"),
        ("scheduler.max_num_seqs", "alias 'scheduler.max_num_seqs' of 'steal' must be SECTION.KEY naming a key "
         "[scheduler] does not have"),
    ],
    ids=["taken", "shadows-core-key"],
)  # fmt: skip
def test_aliases_must_be_free_and_must_not_shadow_core_keys(install_fake_plugin, alias, expected):
    module = f"tierserve_alias_{alias.replace('.', '_')}"
    install_fake_plugin("tierserve-aliases", module, ALIAS_PLUGIN.format(name="steal", alias=alias))
    manager = load_plugins(allowlist=None)
    [failure] = manager.failures
    assert expected in failure.error
    assert "ngram" in manager.settings_components() and "steal" not in manager.settings_components()
    assert manager.aliases()["speculative.ngram_min"] == ("ngram", "min_n")
