"""Chat templates of the model families users pick (tests/templates/: written here from each family's documented
rules): the protocol's token-in / token-out prompts over several turns against the template's full render, or,
where the family's rules make the full render differ, against what the model was shown; templates whose deltas are
not well defined are refused at start naming --chat-template; a script run with the Qwen3 hybrid template."""

import copy
import itertools
import json
import re
from pathlib import Path

import pytest
from tokenizers import AddedToken

import adca_grpo
import common
import gigpo
import harness
import tempo

TEMPLATES = Path(__file__).parent / "templates"
TOOL = '<tool_call>\n{"name": "alfworld_step", "arguments": {"action": "%s"}}\n</tool_call>'
QWEN3_EMPTY_THINK = "<think>\n\n</think>\n\n"

OTHER_APPEND_ONLY_TEMPLATE = """\
{%- for message in messages %}
{%- if message.role == 'system' %}<|im_start|>system
{{ message.content }}{% if tools %}
Tools: {% for tool in tools %}{{ tool.function.name }}({{ tool.function.parameters.properties | list | join(', ') }}) {% endfor %}{% endif %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>tool
{{ message.content }}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

DROPS_OLD_THINKING_TEMPLATE = """\
{%- for message in messages %}
{%- set content = message.content %}
{%- if message.role == 'assistant' and not loop.last and '</think>' in content %}
{%- set content = content.split('</think>')[-1].lstrip('\\n') %}
{%- endif %}<|im_start|>{{ 'user' if message.role == 'tool' else message.role }}
{{ content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

# Shows the model only the latest tool result: earlier ones are rewritten to "(seen)" once a new one arrives.
DROPS_OLD_OBSERVATIONS_TEMPLATE = """\
{%- set last_tool = namespace(index=-1) %}
{%- for message in messages %}{% if message.role == 'tool' %}{% set last_tool.index = loop.index0 %}{% endif %}{% endfor %}
{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content if message.role != 'tool' or loop.index0 == last_tool.index else '(seen)' }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def with_template(tokenizer, template: str | None):
    other = copy.deepcopy(tokenizer)
    if template is not None:
        other.chat_template = (TEMPLATES / template).read_text() if template.endswith(".jinja") else template
    return other


def llama_tokenizer(tokenizer):
    """The tiny tokenizer with Llama 3's special tokens: BOS, header marks, and <|eot_id|> as the end of a turn."""
    other = with_template(tokenizer, "llama3.jinja")
    other.add_special_tokens({"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"})
    marks = ["<|start_header_id|>", "<|end_header_id|>"]
    other.add_tokens([AddedToken(mark, special=True, normalized=False) for mark in marks], special_tokens=True)
    return other


def qwen3_shown(full: str, replies) -> str:
    """Qwen3 with enable_thinking=False: the model saw every reply after the generation prompt's empty think block,
    which the template's full render drops from replies without reasoning."""
    for reply in replies:
        full = full.replace("<|im_start|>assistant\n" + reply, "<|im_start|>assistant\n" + QWEN3_EMPTY_THINK + reply)
    return full


# family: (tokenizer from the tiny one, enable_thinking, the text the model was shown given the full render)
FAMILIES = {
    "qwen2.5 (the tiny model's own)": (lambda tok: tok, True, None),
    "qwen3 hybrid, thinking on": (lambda tok: with_template(tok, "qwen3.jinja"), True, None),
    "qwen3 hybrid, thinking off": (lambda tok: with_template(tok, "qwen3.jinja"), False, qwen3_shown),
    "llama 3 tools": (llama_tokenizer, True, None),
    "plain role tags": (lambda tok: with_template(tok, OTHER_APPEND_ONLY_TEMPLATE), True, None),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_prompts_over_several_turns_are_what_the_template_showed_the_model(tokenizer, family):
    make_tokenizer, enable_thinking, shown_rule = FAMILIES[family]
    tok = make_tokenizer(tokenizer)
    protocol = common.ChatProtocol(tok, enable_thinking=enable_thinking)
    tokens, messages = protocol.initial(
        "You are in a room.\n\nYour task is to: put a mug in shelf.", ["look", "go to shelf 1"]
    )
    replies = [
        "<think>\nfirst the shelf\n</think>\n\n" + TOOL % "go to shelf 1",
        "no call at all",  # truncated: no end-of-turn token
        TOOL % "look",
        "<think>\nthe mug\n</think>\n\n" + TOOL % "take mug 1 from shelf 1",
    ]
    for turn, reply in enumerate(replies):
        completion = protocol.encode(reply) + ([protocol.eos_token_id] if turn != 1 else [])
        content = protocol.tool_message(common.STATUS_EXECUTED, f"observation {turn}", ["look", "inventory"])
        tokens = tokens + completion + protocol.delta(completion, content)
        messages += [{"role": "assistant", "content": reply}, {"role": "tool", "content": content}]
        full = tok.apply_chat_template(
            messages,
            tools=[common.ALFWORLD_TOOL],
            tokenize=False,
            add_generation_prompt=True,
            enable_thinking=enable_thinking,
        )
        shown = shown_rule(full, replies[: turn + 1]) if shown_rule else full
        assert tokens == tok.encode(shown, add_special_tokens=False)
        assert tok.decode(tokens) == shown
    if shown_rule:  # the family's full render does differ from what the model saw
        assert shown != full and shown.count(QWEN3_EMPTY_THINK) == len(replies) + 1


def test_qwen3_renders_a_last_reply_unlike_earlier_ones(tokenizer):
    """Why the old suffix check refused Qwen3: as the last message, a reply gets an empty think block."""
    tok = with_template(tokenizer, "qwen3.jinja")
    chat = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]
    assert tok.apply_chat_template(chat, tokenize=False).endswith(
        "<|im_start|>assistant\n" + QWEN3_EMPTY_THINK + "A<|im_end|>\n"
    )
    protocol = common.ChatProtocol(tok)
    assert protocol.tool_head == "<|im_end|>\n<|im_start|>user\n<tool_response>\n"
    assert protocol.tool_tail == "\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert common.ChatProtocol(tok, enable_thinking=False).tool_tail.endswith("assistant\n" + QWEN3_EMPTY_THINK)


@pytest.mark.parametrize("template", [DROPS_OLD_THINKING_TEMPLATE, DROPS_OLD_OBSERVATIONS_TEMPLATE])
def test_template_that_rewrites_shown_history_is_refused(tokenizer, template):
    with pytest.raises(common.TemplateNotAppendOnlyError, match="rewrites turns it already showed.*--chat-template"):
        common.ChatProtocol(with_template(tokenizer, template))


@pytest.mark.parametrize(
    "template, enable_thinking, message",  # template: the file's text; None: a file that is not there; "": no flag
    [
        (DROPS_OLD_THINKING_TEMPLATE, True, r"rewrites turns it already showed the model .*--chat-template FILE"),
        (None, True, r"--chat-template .*template.jinja: cannot read it"),
        ("{{ messages[0].nope.deeper }}", True, r"cannot render a chat of system, user.*--chat-template FILE"),
        ("", False, r"--no-enable-thinking: the chat template has no enable_thinking switch"),
    ],
)
def test_a_script_refuses_a_template_at_start_naming_the_flag(games_root, tmp_path, template, enable_thinking, message):
    path = "" if template == "" else tmp_path / "template.jinja"
    if template:
        path.write_text(template)
    args = gigpo.Args(
        model="tiny",
        data_root=str(games_root),
        output_dir=str(tmp_path),
        chat_template=str(path),
        enable_thinking=enable_thinking,
    )
    with pytest.raises(harness.StartupError, match=message):
        gigpo.main(args)


# --------------------------------------------------------------------------------------------
# a script run with the Qwen3 hybrid template: every prompt token-exact over several turns
# --------------------------------------------------------------------------------------------
def runs(traj) -> list[tuple[int, list[int]]]:
    """The trajectory's tokens cut where the step id changes: (-1, context tokens) or (k, step k's sampled tokens)."""
    pairs = zip(traj.tokens, traj.step_ids, strict=True)
    return [(step, [token for token, _ in run]) for step, run in itertools.groupby(pairs, key=lambda pair: pair[1])]


def template_pieces(tokenizer, messages, enable_thinking) -> list[str]:
    """The template's text around the replies, each reply put in as a placeholder without reasoning (the sampled
    replies of the random model may hold stray think tags, which a full render would rewrite)."""
    placeholders = [f"[reply {k}]" for k in range(len(messages))]
    chat = [{**m, "content": placeholders[k]} if m["role"] == "assistant" else m for k, m in enumerate(messages)]
    text = tokenizer.apply_chat_template(
        chat, tools=[common.ALFWORLD_TOOL], tokenize=False, add_generation_prompt=True, enable_thinking=enable_thinking
    )
    if not enable_thinking:
        text = qwen3_shown(text, [p for p, m in zip(placeholders, messages) if m["role"] == "assistant"])
    return re.split(r"\[reply \d+\]", text)


@pytest.mark.slow
@pytest.mark.parametrize("enable_thinking", [True, False])
def test_script_with_the_qwen3_template_builds_token_exact_prompts(
    games_root, tiny_model_dir, tokenizer, tmp_path, monkeypatch, enable_thinking
):
    played = []

    def recording_rollout(*args, **kwargs):
        groups = rollout(*args, **kwargs)
        played.extend(traj for group in groups for traj in group)
        return groups

    rollout = common.rollout
    monkeypatch.setattr(common, "rollout", recording_rollout)
    template = TEMPLATES.resolve() / "qwen3.jinja"
    argv = ["smoke", "--model", str(tiny_model_dir), "--data-root", str(games_root), "--output-dir", str(tmp_path)]
    argv += ["--num-updates", "1", "--eval-every", "0", "--chat-template", str(template)]
    argv += [] if enable_thinking else ["--no-enable-thinking"]
    run_dir = harness.cli(gigpo.Args, gigpo.main, gigpo.PRESETS, argv=argv)

    config = json.loads((run_dir / "config.json").read_text())
    assert config["chat_template"] == str(template) and config["enable_thinking"] is enable_thinking
    qwen3 = with_template(tokenizer, "qwen3.jinja")
    assert played and max(len(traj.steps) for traj in played) >= 3
    for traj in played:
        cut = runs(traj)
        assert [step for step, _ in cut] == [-1] + [x for k in range(len(traj.steps)) for x in (k, -1)]
        context, sampled = [tokens for step, tokens in cut if step < 0], [tokens for step, tokens in cut if step >= 0]
        assert sampled == [step.completion_tokens for step in traj.steps]
        pieces = template_pieces(qwen3, traj.messages, enable_thinking)
        assert len(pieces) == len(context)
        expected = [qwen3.encode(pieces[0], add_special_tokens=False)]
        for reply, piece in zip(sampled, pieces[1:]):
            if reply[-1] == qwen3.eos_token_id:  # the model ended its turn itself: the closing starts after it
                piece = piece.removeprefix(qwen3.eos_token)
            expected.append(qwen3.encode(piece, add_special_tokens=False))
        assert context == expected
        shown = "".join(pieces)
        assert (QWEN3_EMPTY_THINK in shown) is (not enable_thinking)


@pytest.mark.slow
def test_sft_trains_on_what_the_model_is_shown_and_saves_the_template(games_root, tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    import sft

    out = tmp_path / "sft"
    args = sft.Args(
        model=str(tiny_model_dir),
        chat_template=str(TEMPLATES / "qwen3.jinja"),
        enable_thinking=False,
        output_dir=str(out),
        data_root=str(games_root),
        task_types=("look_at_obj_in_light",),
        num_games=1,
        max_turns=4,
        num_epochs=1,
    )
    sft.main(args)
    saved = AutoTokenizer.from_pretrained(out)
    assert saved.chat_template == (TEMPLATES / "qwen3.jinja").read_text()  # RL on this model needs no flag
    protocol = common.ChatProtocol(saved, enable_thinking=False)
    (example,), _ = sft.build_examples(
        common.discover_games(str(games_root), "train", args.task_types)[:1], protocol, args
    )
    text = saved.decode(example.tokens)
    trained = [t for t, m in zip(example.tokens, example.mask) if m]
    replies = trained.count(saved.eos_token_id)  # every expert reply ends its turn
    assert replies >= 2 and text.count("<|im_start|>assistant\n" + QWEN3_EMPTY_THINK + "<tool_call>") == replies

    drops = tmp_path / "drops.jinja"
    drops.write_text(DROPS_OLD_THINKING_TEMPLATE)
    with pytest.raises(ValueError, match="--chat-template"):
        sft.main(sft.Args(**{**vars(args), "chat_template": str(drops), "enable_thinking": True}))


@pytest.mark.parametrize("enable_thinking", [True, False])
def test_critic_and_self_labeller_prompts_follow_the_thinking_switch(tokenizer, enable_thinking):
    """TEMPO's critic prompt and ADCA's self-labeller prompt are rendered with the actor's --enable-thinking: with
    Qwen3's template off, the generation prompt holds the empty think block."""
    qwen3 = with_template(tokenizer, "qwen3.jinja")
    empty_think = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    prompt = tempo.critic_prompt(qwen3, "put a cup in the sink", ["go to sink 1"], [], 0, 10, 100, enable_thinking)
    critic = qwen3.decode(prompt)
    seen = []

    def greedy(prompts, max_new_tokens):
        seen.extend(qwen3.decode(p) for p in prompts)
        return [common.Completion([qwen3.eos_token_id], [0.0], "GOOD")]

    args = adca_grpo.Args(model="tiny", enable_thinking=enable_thinking)
    request = adca_grpo.LabelRequest("r", [{"role": "user", "content": "label these steps"}], 1)
    adca_grpo.PolicyLabeler(greedy, qwen3, args)([request])
    for text in (critic, seen[0]):
        assert text.endswith(empty_think) != enable_thinking
