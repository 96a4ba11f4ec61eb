"""Config-driven runs: a named preset or a --config file (JSON or YAML, a run's own config.json included) gives the
defaults, flags on the command line override them, and bad files fail at start naming what is wrong."""

import dataclasses
import json
import re
from pathlib import Path

import pytest
import yaml
from algorithm_scripts import MODULES

import adca_grpo
import gigpo
import harness
import offline
import ppo
import samplers
import tempo
from benchmarks.learning import runs

ROOT = Path(__file__).resolve().parents[1]


def parsed(module, argv):
    """The Args the command line gives (main replaced by the identity)."""
    return harness.cli(module.Args, lambda args: args, module.PRESETS, argv=argv)


@pytest.mark.parametrize("module", MODULES.values(), ids=MODULES)
def test_a_preset_gives_the_defaults_and_flags_override_it(module):
    _, preset = module.PRESETS["smoke"]
    args = parsed(module, ["smoke", "--seed", "7"])
    assert args.model == "tiny" and args.seed == 7 and args.preset == "smoke"
    assert args == type(preset)(**{**vars(preset), "seed": 7, "preset": "smoke"})
    assert parsed(module, ["--preset", "smoke", "--seed", "7"]) == args
    assert parsed(module, ["--seed", "7"]) == module.Args(seed=7)  # plain flags: as before


def test_an_unknown_preset_fails_at_start(capsys):
    with pytest.raises(SystemExit) as exit:
        parsed(tempo, ["--preset", "smok"])
    assert (
        exit.value.code == 2
        and "--preset must be one of ['learning', 'learning-long', 'smoke', 'source'], got 'smok'"
        in capsys.readouterr().err
    )


def test_help_shows_the_presets_values(capsys, monkeypatch):
    """`tempo.py source --help` resolves the source's store rule; plain --help shows Args()'s."""
    monkeypatch.setenv("COLUMNS", "400")  # one line per flag's help
    for argv, store in ((["source", "--help"], "source"), (["--help"], tempo.Args().state_selection)):
        with pytest.raises(SystemExit) as exit:
            parsed(tempo, argv)
        (line,) = [line for line in capsys.readouterr().out.splitlines() if "drawn states kept" in line]
        assert exit.value.code == 0 and f"(default: {store})" in line
    assert tempo.PRESETS["source"][1].state_selection == "source" != tempo.Args().state_selection


def test_a_yaml_config_file_gives_the_defaults(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("learning_rate: 3.0e-4\nclip_eps_high: 0.28\nprefix_is_correction: true\ntask_types: null\n")
    args = parsed(tempo, ["--config", str(config), "--seed", "3"])
    assert (args.learning_rate, args.clip_eps_high, args.prefix_is_correction, args.seed) == (3e-4, 0.28, True, 3)
    assert args.config == str(config) and args.td_updates == tempo.Args().td_updates
    over_preset = parsed(tempo, ["smoke", "--config", str(config)])
    assert over_preset.model == "tiny" and over_preset.learning_rate == 3e-4  # preset, then the file, then flags


@pytest.mark.parametrize(
    "text, message",
    [
        ("learning_rte: 0.1\n", "unknown keys ['learning_rte']"),
        ("- 1\n- 2\n", "expected a mapping"),
        ("learning_rate: [0.1\n", "cannot read it"),
        ("learning_rate: fast\n", "a value above is not valid"),
    ],
)
def test_a_bad_config_file_fails_at_start_naming_it(tmp_path, capsys, text, message):
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    with pytest.raises(SystemExit) as exit:
        parsed(adca_grpo, ["--config", str(config)])
    assert exit.value.code == 2 and re.search(re.escape(f"--config {config}: {message}"), capsys.readouterr().err)


# config.json files of runs from before the scripts took one vocabulary (harness.RENAMED_FLAGS)
OLD_CONFIGS = {
    tempo: (
        dict(max_episode_steps=8, branches=3, states_per_batch=2, warmup_games_per_batch=5, ppo_clip=[0.2, 0.28]),
        dict(
            max_turns=8, group_size=3, groups_per_update=2, warmup_groups_per_update=5, clip_eps=0.2, clip_eps_high=0.28
        ),
    ),
    gigpo: (dict(games_per_update=3, trajectories_per_game=5), dict(groups_per_update=3, group_size=5)),
    adca_grpo: (dict(games_per_update=3, trajectories_per_game=5), dict(groups_per_update=3, group_size=5)),
}


def test_a_config_with_a_removed_flag_loads_at_its_old_value_and_is_refused_at_another(tmp_path, capsys):
    """harness.REMOVED_FLAGS: a run's config.json from before a flag was removed reruns when the flag held the value
    every run without it has; at another value the run needs the commit that had the flag, and the error names it."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"seed": 4, "critic_replay": 0, "critic_coef": 1.0}))
    assert parsed(tempo, ["--config", str(config)]).seed == 4
    assert "critic_replay dropped" in capsys.readouterr().err
    config.write_text(json.dumps({"critic_replay": 8}))
    with pytest.raises(SystemExit):
        parsed(tempo, ["--config", str(config)])
    assert "critic_replay = 8 is no longer a flag; that run needs commit 3d8e148" in capsys.readouterr().err


@pytest.mark.parametrize("module", OLD_CONFIGS)
def test_a_config_with_the_old_flag_names_loads_under_the_new_ones(module, tmp_path, capsys):
    old, new = OLD_CONFIGS[module]
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"seed": 4, **old}))
    args = parsed(module, ["--config", str(config)])
    assert {key: getattr(args, key) for key in new} == new and args.seed == 4
    assert f"--config {config}: old flag names read as the new ones: " in capsys.readouterr().err
    config.write_text(json.dumps({**old, **new}))  # the old name beside the new one: which one is meant?
    with pytest.raises(SystemExit):
        parsed(module, ["--config", str(config)])
    assert "keep only the new" in capsys.readouterr().err


def test_an_old_ppo_clip_of_none_is_the_importance_sampling_loss(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"ppo_clip": None}))
    assert (parsed(tempo, ["--config", str(config)]).clip_eps, tempo.Args().clip_eps) == (None, None)


@pytest.mark.slow
def test_a_runs_config_json_reruns_it_exactly(games_root, tiny_model_dir, tmp_path):
    flags = ["--model", str(tiny_model_dir), "--data-root", str(games_root), "--output-dir", str(tmp_path / "a")]
    flags += ["--num-updates", "1", "--groups-per-update", "2", "--group-size", "2", "--max-turns", "2"]
    flags += [
        "--max-turn-tokens",
        "16",
        "--lora-rank",
        "4",
        "--lora-alpha",
        "8",
        "--no-attribution",
        "--eval-every",
        "0",
    ]
    first = harness.cli(adca_grpo.Args, adca_grpo.main, adca_grpo.PRESETS, argv=flags)
    config = first / "config.json"
    again = harness.cli(
        adca_grpo.Args,
        adca_grpo.main,
        adca_grpo.PRESETS,
        argv=["--config", str(config), "--output-dir", str(tmp_path / "b")],
    )
    assert json.loads((again / "config.json").read_text())["config"] == str(config)
    rows = [json.loads((run / "metrics.jsonl").read_text()) for run in (first, again)]
    untimed = [{k: v for k, v in row.items() if not k.startswith("time/")} for row in rows]
    assert untimed[0] == untimed[1] and untimed[0]["rollout/generated_tokens"] > 0


@pytest.mark.parametrize("module", MODULES.values(), ids=MODULES)
def test_every_script_has_the_shared_presets_and_every_preset_is_valid(module):
    """smoke (tests, the quickstart), learning / learning-long (benchmarks/learning) and source (the settings of the
    code it reproduces, written once: there, with where they come from)."""
    assert {"smoke", "learning", "learning-long", "source"} <= set(module.PRESETS)
    for _, preset in module.PRESETS.values():
        module.validate_args(preset)


CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def config_script(path: Path):
    """The script a configs/ file is for: the one its `# Run:` line launches, with this file."""
    run = rf"^# Run: accelerate launch (\w+)\.py --config configs/{re.escape(path.name)} "
    (script,) = re.findall(run, path.read_text(), re.M)
    return MODULES[script]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda path: path.name)
def test_the_shipped_config_files_parse_and_equal_their_source_preset(path):
    """configs/ holds each script's source preset as a file to copy and edit (the preset is where the values live), and
    the matched baselines of the published comparisons (docs/reproduce.md)."""
    module = config_script(path)
    args = parsed(module, ["--config", str(path)])
    preset = re.search(r"The same values as `python \w+\.py (\w+)`", path.read_text())
    if preset:
        assert dataclasses.replace(args, config="") == module.PRESETS[preset.group(1)][1]
    else:
        module.validate_args(args)


DIFFERENCE = re.compile(r"^#   (\w+) = (.+?): ", re.M)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda path: path.name)
def test_a_config_states_its_source_and_each_value_it_runs_differently(path):
    """Its first line names the source (a paper, code at a commit, a lab repository); each setting it runs differently
    is listed with the value it runs, and that value is the config's."""
    text = path.read_text()
    assert text.startswith("# Source: ") and "# Run differently here" in text and "# Not expressible here:" in text
    args = parsed(config_script(path), ["--config", str(path)])
    differences = DIFFERENCE.findall(text)
    assert differences
    for key, value in differences:
        ours = getattr(args, key)
        assert (list(ours) if isinstance(ours, tuple) else ours) == yaml.safe_load(value), key


# The published comparisons as config pairs: the keys they may differ in besides their scripts' own (GiGPO vs GRPO:
# the step advantage's weight; TEMPO vs GRPO: TEMPO's importance-sampling loss has no PPO clip); exp_name names the run.
PAIRS = {
    ("gigpo-qwen2.5-1.5b.yaml", "grpo-qwen2.5-1.5b.yaml"): {"step_advantage_w"},
    ("gigpo-qwen2.5-7b.yaml", "grpo-qwen2.5-7b.yaml"): {"step_advantage_w"},
    ("tempo-qwen3.5-4b.yaml", "grpo-qwen3.5-4b.yaml"): {"clip_eps"},
}


@pytest.mark.parametrize("pair", PAIRS, ids=lambda pair: " vs ".join(pair))
def test_each_published_comparison_is_a_pair_of_configs_that_differ_only_in_the_algorithm(pair):
    paths = [ROOT / "configs" / name for name in pair]
    for path, other in zip(paths, reversed(pair)):  # each names its twin
        assert f"# Pair: configs/{other} " in path.read_text()
    first, second = (parsed(config_script(path), ["--config", str(path)]) for path in paths)
    shared = {f.name for f in dataclasses.fields(first)} & {f.name for f in dataclasses.fields(second)}
    differing = {key for key in shared - {"config", "exp_name"} if getattr(first, key) != getattr(second, key)}
    assert differing == PAIRS[pair]
    assert {p.name for p in CONFIGS} >= set(pair)


def test_every_grpo_config_is_gigpo_without_its_step_advantage():
    """The configs' GRPO is verl-agent's: gigpo.py at --step-advantage-w 0 (A = A_E), a twin of a published
    comparison, its runs named grpo-verl (grpo is adca_grpo.py --no-attribution's: plot.py would merge the two)."""
    grpo = [path for path in CONFIGS if path.name.startswith("grpo-")]
    assert grpo and all(any(path.name in pair for pair in PAIRS) for path in grpo)
    for path in grpo:
        args = parsed(config_script(path), ["--config", str(path)])
        assert config_script(path) is gigpo and (args.step_advantage_w, args.exp_name) == (0.0, "grpo-verl")


@pytest.mark.parametrize("setting", ["short", "long"])
@pytest.mark.parametrize("module", MODULES.values(), ids=MODULES)
def test_the_learning_presets_are_what_the_learning_benchmark_runs(module, setting):
    agent, preset_name = runs.SETTINGS[setting]
    script = f"{module.__name__}.py"
    for name in [name for name, (s, _) in runs.ALGORITHMS.items() if s == script]:
        url = "http://127.0.0.1:8011/v1" if runs.needs_server(name) else ""  # compare.py's server, for those arms
        command = runs.algorithm_command(name, 2, 12, Path("/m"), Path("/g"), Path("/r"), setting, 6, sampler_url=url)
        assert command[:2] == [script, preset_name]
        args = parsed(module, command[1:])
        assert (args.model, args.data_root, args.seed, args.preset) == ("/m", "/g", 2, preset_name)
        chosen = samplers.sampler_choice(args)[0]  # the CPU's choice for --sampler auto: generate
        assert (chosen, args.sampler_url) == (("vllm", url) if url else ("generate", ""))
    _, preset = module.PRESETS[preset_name]
    assert preset.model == agent and preset.task_types == offline.TINY_AGENTS[agent].task_types
    recipe = runs.recipe(setting)  # what the benchmark's evaluation plays
    assert (preset.max_turn_tokens, preset.max_trajectory_tokens) == (
        recipe.max_turn_tokens,
        recipe.max_trajectory_tokens,
    )
    assert preset.max_turns == recipe.max_turns


def test_the_async_arms_differ_from_their_baseline_only_in_async_steps():
    """grpo_async1 against grpo_vllm (compare.py --reference grpo_vllm): the same command but --async-steps; an arm
    that samples through a server is refused a command without its URL."""
    url, where = "http://127.0.0.1:8011/v1", (Path("/m"), Path("/g"), Path("/r"))
    base, ahead = (
        parsed(adca_grpo, runs.algorithm_command(name, 1, 12, *where, "short", 6, sampler_url=url)[1:])
        for name in ("grpo_vllm", "grpo_async1")
    )
    assert (base.async_steps, ahead.async_steps) == (0, 1)
    assert dataclasses.replace(ahead, async_steps=0, exp_name=base.exp_name) == base
    with pytest.raises(ValueError, match="'grpo_async1' samples through a vLLM server"):
        runs.algorithm_command("grpo_async1", 1, 12, *where, "short", 6)


def test_a_tempo_variant_without_warmup_gets_the_runs_updates_as_td_updates():
    for name, (warmup, td) in {"tempo": (3, 21), "tempo_fixed_critic": (0, 24)}.items():
        command = runs.algorithm_command(name, 1, 12, Path("/m"), Path("/g"), Path("/r"), "long", 12, 21)
        args = parsed(tempo, command[1:])
        assert (args.warmup_updates, args.td_updates) == (warmup, td)
        assert runs.run_updates(name, 12, 21) == 24  # the same checkpoints for every TEMPO variant


def test_the_learning_benchmark_runs_a_variant_at_another_learning_rate():
    command = runs.algorithm_command("tempo_ppo@3e-3", 1, 12, Path("/m"), Path("/g"), Path("/r"), "short", 6)
    args = parsed(tempo, command[1:])
    assert (args.learning_rate, args.clip_eps, args.clip_eps_high) == (
        3e-3,
        0.2,
        0.28,
    )  # the variant's clip, the sweep's lr
    assert command[command.index("--exp-name") + 1] == "tempo_ppo@3e-3-s1"
    assert (
        parsed(adca_grpo, runs.algorithm_command("grpo", 1, 12, *[Path("/x")] * 3, "short", 6)[1:]).learning_rate
        == 1e-3
    )
    for name, message in (
        ("tempo@fast", "'fast' after '@' is not a learning rate"),
        ("nope@1e-3", "unknown 'nope@1e-3'"),
    ):
        with pytest.raises(ValueError, match=message):
            runs.algorithm(name)


def test_the_ranking_settings_policy_gradient_arms_share_one_clip():
    """GRPO, ADCA-GRPO, GiGPO and PPO clip alike in the learning presets (the ranking's); TEMPO's own loss has none."""
    clips = {
        (m.PRESETS["learning"][1].clip_eps, m.PRESETS["learning"][1].clip_eps_high) for m in (adca_grpo, gigpo, ppo)
    }
    assert clips == {(0.2, 0.28)}
