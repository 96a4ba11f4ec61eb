# =============================================================================================
# ADCA advantages (update steps 2 and 4): AgentEvolver's decouple fusion of labels and outcomes
# =============================================================================================
EPS = 1e-8


def group_outcome_advantages(orm_scores: Sequence[float], group_ids: Sequence[int]) -> list[float]:
    """GRPO's outcome advantage: z-score of the outcome within its group (only centred when the
    group's outcomes are all equal, so a uniform group gets exactly 0)."""
    members = defaultdict(list)
    for i, group in enumerate(group_ids):
        members[group].append(i)
    advantages = [0.0] * len(orm_scores)
    for idxs in members.values():
        scores = [float(orm_scores[i]) for i in idxs]
        mean = math.fsum(scores) / len(scores)
        std = math.sqrt(math.fsum((s - mean) ** 2 for s in scores) / len(scores))  # population std
        for i, score in zip(idxs, scores):
            advantages[i] = score - mean if std <= EPS else (score - mean) / (std + 1e-12)
    return advantages


def _prm_zscores(step_flags: Sequence[Sequence[bool]], group_ids: Sequence[int], fix_base: float, equal_trajectory_weight: bool) -> list[list[float]]:
    """+fix_base for GOOD, -fix_base for BAD, z-scored within each group over its steps."""
    raw = [[fix_base if flag else -fix_base for flag in flags] for flags in step_flags]
    members = defaultdict(list)
    for i, group in enumerate(group_ids):
        if raw[i]:
            members[group].append(i)
    z = [[] for _ in raw]
    for idxs in members.values():
        if len({r for i in idxs for r in raw[i]}) == 1:
            for i in idxs:  # all labels equal: exactly 0 (the formula gives rounding noise / sqrt(eps))
                z[i] = [0.0] * len(raw[i])
            continue
        if equal_trajectory_weight:  # every trajectory weighs the same, however many steps it has
            mean = math.fsum(math.fsum(raw[i]) / len(raw[i]) for i in idxs) / len(idxs)
            var = math.fsum(math.fsum((r - mean) ** 2 for r in raw[i]) / len(raw[i]) for i in idxs) / len(idxs)
            sd = math.sqrt(var + EPS)
        else:  # every step weighs the same
            flat = [r for i in idxs for r in raw[i]]
            mean = math.fsum(flat) / len(flat)
            sd = max(math.sqrt(math.fsum((r - mean) ** 2 for r in flat) / len(flat)), EPS)
        for i in idxs:
            z[i] = [(r - mean) / (sd + 1e-12) for r in raw[i]]
    return z


def _check_decouple_inputs(orm_scores, step_flags, group_ids, orm_distribution):
    if not len(orm_scores) == len(step_flags) == len(group_ids):
        raise ValueError(f"orm_scores, step_flags and group_ids differ in length: {len(orm_scores)}, {len(step_flags)}, {len(group_ids)}")
    if orm_distribution not in ORM_DISTRIBUTIONS:
        raise ValueError(f"unknown orm_distribution {orm_distribution!r}; expected one of {ORM_DISTRIBUTIONS}")


def decouple_step_rewards(
    orm_scores: Sequence[float],
    step_flags: Sequence[Sequence[bool]],
    group_ids: Sequence[int],
    *,
    fix_base: float,
    alpha: float,
    orm_distribution: str,
    equal_trajectory_weight: bool,
    length_normalization: bool,
) -> list[list[float]]:
    """AgentEvolver's `decouple` scheme: PRM labels and ORM outcomes are z-scored separately within
    each group, then fused per step: alpha * z_prm + the outcome advantage (on the last step or on
    every step), optionally scaled by 1/sqrt(steps). A trajectory without steps gets []."""
    _check_decouple_inputs(orm_scores, step_flags, group_ids, orm_distribution)
    prm_z = _prm_zscores(step_flags, group_ids, fix_base, equal_trajectory_weight)
    outcome_adv = group_outcome_advantages(orm_scores, group_ids)
    rewards = []
    for z, adv in zip(prm_z, outcome_adv):
        num_steps = len(z)
        scale = 1.0 / math.sqrt(num_steps) if length_normalization and num_steps else 1.0
        fused = [alpha * zj + (adv if orm_distribution == "all_steps" or j == num_steps - 1 else 0.0) for j, zj in enumerate(z)]
        rewards.append([c * scale for c in fused])
    return rewards


def decouple_health_metrics(
    orm_scores: Sequence[float],
    step_flags: Sequence[Sequence[bool]],
    group_ids: Sequence[int],
    *,
    fix_base: float,
    alpha: float,
    orm_distribution: str,
    equal_trajectory_weight: bool,
    length_normalization: bool,
) -> dict[str, float]:
    """AgentEvolver's decouple dashboard: how large the attribution term is next to the outcome term
    and whether the labels agree with the outcomes. A trajectory is positive when its score is > 0."""
    _check_decouple_inputs(orm_scores, step_flags, group_ids, orm_distribution)
    prm_z = _prm_zscores(step_flags, group_ids, fix_base, equal_trajectory_weight)
    outcome_adv = group_outcome_advantages(orm_scores, group_ids)
    fused = decouple_step_rewards(orm_scores, step_flags, group_ids, fix_base=fix_base, alpha=alpha, orm_distribution=orm_distribution,
                                  equal_trajectory_weight=equal_trajectory_weight, length_normalization=length_normalization)  # fmt: skip
    attr_values, out_values, shares, alpha_ratios, sign_agree = [], [], [], [], []
    positives = positive_good_majority = negatives = negative_bad_majority = 0
    for i, z in enumerate(prm_z):
        if not z:
            continue
        attr_values += z
        out_values.append(outcome_adv[i])
        attr_abs = math.fsum(abs(alpha * zj) for zj in z)
        out_last = abs(outcome_adv[i])
        out_abs = out_last * (len(z) if orm_distribution == "all_steps" else 1)
        shares.append(out_last / (out_last + attr_abs + 1e-12))
        alpha_ratios.append(attr_abs / (out_abs + 1e-12))
        positive = float(orm_scores[i]) > 0
        sign_agree.append(float((math.fsum(fused[i]) > 0) == positive))
        num_good = sum(bool(f) for f in step_flags[i])
        if positive:
            positives += 1
            positive_good_majority += num_good > len(z) - num_good
        else:
            negatives += 1
            negative_bad_majority += num_good <= len(z) - num_good

    def mean(values):
        return math.fsum(values) / len(values) if values else 0.0

    def std(values):
        m = mean(values)
        return math.sqrt(mean([(v - m) ** 2 for v in values])) if values else 0.0

    return {
        "prm/decouple/attr_mean": mean(attr_values),
        "prm/decouple/attr_std": std(attr_values),
        "prm/decouple/out_mean": mean(out_values),
        "prm/decouple/out_std": std(out_values),
        "prm/decouple/outcome_share_last_mean": mean(shares),
        "prm/decouple/alpha_effective": mean(alpha_ratios),
        "prm/decouple/sum_step_reward_sign_agree": mean(sign_agree),
        "prm/decouple/pos_traj_prm_good_majority_rate": positive_good_majority / max(1, positives),
        "prm/decouple/neg_traj_prm_bad_majority_rate": negative_bad_majority / max(1, negatives),
    }


def suffix_sum(step_rewards: Sequence[Sequence[float]]) -> list[list[float]]:
    """Advantage of step j = sum of the step rewards from j to the end: [1, 2, 3] -> [6, 5, 3]."""
    out = []
    for rewards in step_rewards:
        sums, running = [], 0.0
        for reward in reversed(rewards):
            running += reward
            sums.append(running)
        out.append(sums[::-1])
    return out


def broadcast_to_tokens(step_advantages: Sequence[Sequence[float]], step_ids: torch.Tensor) -> torch.Tensor:
    """(B, L) step ids (-1 = context) -> (B, L) float advantages: every token generated at step k
    gets its row's step_advantages[k]; context tokens get 0."""
    if step_ids.dim() != 2 or len(step_advantages) != step_ids.shape[0]:
        raise ValueError(f"step_ids must be (B, L) with B = {len(step_advantages)} rows, got shape {tuple(step_ids.shape)}")
    width = max((len(row) for row in step_advantages), default=0)
    table = torch.zeros(len(step_advantages), width + 1, dtype=torch.float32)  # last column: 0 for context
    for i, row in enumerate(step_advantages):
        table[i, : len(row)] = torch.tensor(row, dtype=torch.float32)
    lengths = torch.tensor([len(row) for row in step_advantages]).unsqueeze(1)
    ids = step_ids.long().cpu()
    if bool((ids >= lengths).any()):
        raise ValueError("step_ids refer to a step beyond the advantages given for that row")
    index = torch.where(ids >= 0, ids, torch.full_like(ids, width))
    return table.gather(1, index).to(step_ids.device)


def alpha_at(update: int, args: Args) -> float:
    """Attribution weight for this update: constant, or cosine from --alpha down to --alpha-min."""
    if not args.attribution:
        return 0.0
    if args.alpha_schedule == "constant":
        return args.alpha
    progress = min(update / max(1, args.num_updates - 1), 1.0)
    return args.alpha_min + 0.5 * (args.alpha - args.alpha_min) * (1.0 + math.cos(math.pi * progress))


# =============================================================================================
# ADCA labels (update step 3): one request per trajectory, every step judged GOOD or BAD
# =============================================================================================
# Steps are numbered from 1 in the prompt ("Step 1" is the first step); parse_judgments maps them back to 0-based.
LABEL_SYSTEM_PROMPT = (
    "You evaluate the individual steps of an agent that played a household text game (ALFWorld). You receive the "
    "task, the numbered steps (the action the agent sent and what the game answered) and the episode's overall "
    "score. A positive score means this attempt ended better than the other attempts at the same task; a negative "
    "score means it ended worse.\n"
    "- If the score is positive, a step is GOOD when it moved the agent closer to completing the task (going where "
    "the needed object or receptacle is, taking, cleaning, heating, cooling or placing the right object) and BAD when "
    "it was useless, repeated, invalid or harmful.\n"
    "- If the score is negative, a step is GOOD only when it clearly made progress or corrected an earlier mistake; "
    "otherwise it is BAD.\n"
    "Judge what each action actually did, as the observations show. Reply in the required format and nothing else."
)


JUDGMENT_PATTERN = re.compile(r"\bstep\s+(\d{1,6})\s*judg(?:e)?ment\s*:\s*(good|bad)\b", re.IGNORECASE)


def parse_judgments(text: str, num_steps: int) -> list[bool] | None:
    """GOOD/BAD flags (True = GOOD) for steps 0..num_steps-1 from `Step i Judgment: GOOD|BAD` lines,
    where i counts from 1 as in the prompt. Case-insensitive, markdown emphasis ignored, the last
    judgment of a step wins, numbers outside 1..num_steps are ignored. None unless every step has
    a judgment (or the input is not text). Never raises."""
    if not isinstance(text, str) or not isinstance(num_steps, int) or num_steps < 0:
        return None
    judgments = {}
    for match in JUDGMENT_PATTERN.finditer(text.replace("*", "")):
        step = int(match.group(1)) - 1
        if 0 <= step < num_steps:
            judgments[step] = match.group(2).upper() == "GOOD"
    if len(judgments) != num_steps:
        return None
    return [judgments[j] for j in range(num_steps)]


def _trim(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + " ...[cut]"


def describe_steps(traj: common.Trajectory) -> list[tuple[str, str]]:
    """(action, observation) per step, as the labeller sees them."""
    steps = []
    for step in traj.steps:
        if not step.valid:
            steps.append((f"(no valid action; the reply was: {step.text.strip()})", "Invalid format: the game did not advance."))
        else:
            steps.append((step.action, step.observation if step.admissible else f"Not an admissible action. {step.observation}"))
    return steps


def build_label_messages(task: str, steps: Sequence[tuple[str, str]], overall_score: float, max_step_chars: int) -> list[dict]:
    """The single chat request that asks for a judgment of every step of one trajectory."""
    polarity = "positive" if overall_score > 0 else "negative"
    lines = [f"TASK: {task}", "", f"STEPS ({len(steps)} in total):"]
    for j, (action, observation) in enumerate(steps, start=1):
        lines += [f"Step {j}", f"Action: {_trim(action, max_step_chars)}", f"Observation: {_trim(observation, max_step_chars)}", ""]
    lines += [f"OVERALL SCORE: {overall_score:+.4f} ({polarity})", "",
              f"Judge every step from 1 to {len(steps)}. Answer in exactly this format, nothing else:",
              "Step 1 Analysis: <one or two sentences>", "Step 1 Judgment: GOOD or BAD",
              "Step 2 Analysis: <one or two sentences>", "Step 2 Judgment: GOOD or BAD", "..."]  # fmt: skip
    return [{"role": "system", "content": LABEL_SYSTEM_PROMPT}, {"role": "user", "content": "\n".join(lines)}]


@dataclass
class LabelRequest:
    trajectory_id: str
    messages: list[dict]
    num_steps: int


@dataclass
class LabelReply:
    text: str | None  # None: no reply (errors, refusals, deadline)
    error: str | None
    latency_s: float
    attempts: int


class ContentRefusal(Exception):
    """The endpoint refused the request on content grounds (moderation)."""


class ApiLabeler:
    """Any OpenAI-compatible chat-completions endpoint, through the official async client, with this
    script's retry policy (the client's own retries are off): 429s back off exponentially with
    jitter, other errors linearly, two content refusals give up, and nothing outlives the deadline."""

    def __init__(self, args: Args):
        self.args = args
        if not os.environ.get(args.labeler_api_key_env):
            raise ValueError(
                f"--labeler-api-key-env names {args.labeler_api_key_env}, which is not set; export the labeller's key "
                f"there (any value, e.g. EMPTY, for a local server without auth)"
            )
        self.model_name = args.labeler_model

    def __call__(self, requests: Sequence[LabelRequest]) -> list[LabelReply]:
        return asyncio.run(self._label_all(requests)) if requests else []

    async def _label_all(self, requests: Sequence[LabelRequest]) -> list[LabelReply]:
        args = self.args
        deadline = asyncio.get_running_loop().time() + args.labeler_deadline_s
        semaphore = asyncio.Semaphore(args.labeler_concurrency)
        client = openai.AsyncOpenAI(base_url=args.labeler_base_url, api_key=os.environ[args.labeler_api_key_env], max_retries=0)
        async with client:
            return list(await asyncio.gather(*(self._label_one(client, r, semaphore, deadline) for r in requests)))

    async def _complete(self, client: openai.AsyncOpenAI, messages: list[dict], semaphore: asyncio.Semaphore) -> str:
        async with semaphore:  # held only while a request is in flight, never while backing off
            response = await client.chat.completions.create(
                model=self.args.labeler_model, messages=messages, temperature=0.0,
                max_tokens=self.args.labeler_max_new_tokens, timeout=self.args.labeler_timeout_s,
            )  # fmt: skip
        if not response.choices:
            raise ValueError("reply without choices")
        choice = response.choices[0]
        if choice.finish_reason == "content_filter":
            raise ContentRefusal("finish_reason content_filter")
        return choice.message.content or ""

    async def _label_one(self, client, request: LabelRequest, semaphore: asyncio.Semaphore, deadline: float) -> LabelReply:
        args, loop = self.args, asyncio.get_running_loop()
        start, refusals, error, attempts = loop.time(), 0, None, 0
        while attempts < args.labeler_max_attempts:
            remaining = deadline - loop.time()
            if remaining <= 0:
                error = f"update deadline ({args.labeler_deadline_s} s) passed; last error: {error}"
                break
            attempts += 1
            try:
                text = await asyncio.wait_for(self._complete(client, request.messages, semaphore), timeout=remaining)
                return LabelReply(text, None, loop.time() - start, attempts)
            except TimeoutError:  # the update's deadline, not the per-request timeout (that is openai.APITimeoutError)
                error = f"update deadline ({args.labeler_deadline_s} s) passed; last error: {error}"
                break
            except Exception as exc:  # noqa: BLE001 - every failure is counted, none may crash training
                error = f"{type(exc).__name__}: {exc}"
                message = str(exc).lower()
                if isinstance(exc, ContentRefusal) or (isinstance(exc, openai.BadRequestError) and (
                        "data_inspection_failed" in message or "inappropriate content" in message)):  # fmt: skip
                    refusals += 1
                    if refusals >= 2:
                        break
                if isinstance(exc, openai.RateLimitError) or "rate limit" in message or "429" in message:
                    wait = min(args.labeler_rate_limit_backoff_s * 1.5 ** (attempts - 1), args.labeler_rate_limit_backoff_cap_s)
                    wait *= 1.0 + 0.25 * random.random()
                else:
                    wait = min(args.labeler_error_backoff_s * attempts, args.labeler_error_backoff_cap_s)
                await asyncio.sleep(max(0.0, min(wait, deadline - loop.time())))
        return LabelReply(None, error, loop.time() - start, attempts)


class PolicyLabeler:
    """The policy model itself labels, greedily, in-process (no key needed). The labels are context
    for the advantages only: their tokens never enter a training batch."""

    def __init__(self, generate_greedy: Callable[[list[list[int]], int], list[common.Completion]], tokenizer, args: Args):
        self.generate_greedy, self.tokenizer, self.args = generate_greedy, tokenizer, args
        self.model_name = f"self:{args.model}"

    def __call__(self, requests: Sequence[LabelRequest]) -> list[LabelReply]:
        if not requests:
            return []
        start = time.perf_counter()
        prompts = [self.tokenizer.apply_chat_template(r.messages, add_generation_prompt=True, tokenize=True, return_dict=False)
                   for r in requests]  # fmt: skip
        completions = self.generate_greedy(prompts, self.args.labeler_max_new_tokens)
        latency = (time.perf_counter() - start) / len(requests)
        return [LabelReply(c.text, None, latency, 1) for c in completions]


def label_trajectories(
    trajectories: Sequence[common.Trajectory],
    overall_scores: Sequence[float],
    orm_scores: Sequence[float],
    labeler: Callable[[Sequence[LabelRequest]], list[LabelReply]],
    args: Args,
    update: int,
    rank: int = 0,
    log_file: Path | None = None,
) -> tuple[list[list[bool]], dict[str, float]]:
    """GOOD/BAD flags for every step of every trajectory, and the prm/* metrics.

    A trajectory skipped by --skip-type, or whose request failed or whose reply did not parse,
    gets uniform flags: all GOOD if its overall score is > 0, else all BAD."""
    flags: list[list[bool] | None] = [None] * len(trajectories)
    requests, request_index, skipped = [], [], 0
    for i, (traj, overall, orm) in enumerate(zip(trajectories, overall_scores, orm_scores)):
        skip = (args.skip_type == "skip_small_adv" and abs(overall) < 1e-8) or (args.skip_type == "skip_all_neg" and orm <= 0)
        if skip or not traj.steps:
            skipped += bool(traj.steps)
            continue
        messages = build_label_messages(traj.start.task, describe_steps(traj), overall, args.labeler_max_step_chars)
        requests.append(LabelRequest(f"u{update}-r{rank}-g{traj.group}-b{traj.branch}", messages, len(traj.steps)))
        request_index.append(i)

    replies = labeler(requests)
    failures = parse_failures = judged_steps = judged_good = 0
    latencies = []
    for request, i, reply in zip(requests, request_index, replies):
        parsed = parse_judgments(reply.text, request.num_steps) if reply.text is not None else None
        failures += reply.text is None
        parse_failures += reply.text is not None and parsed is None
        latencies.append(reply.latency_s)
        if parsed is not None:
            flags[i] = parsed
            judged_steps += len(parsed)
            judged_good += sum(parsed)
        if log_file is not None:
            record = {"update": update, "trajectory_id": request.trajectory_id, "messages": request.messages, "reply": reply.text,
                      "flags": parsed, "latency_s": round(reply.latency_s, 4), "attempts": reply.attempts,
                      "model": labeler.model_name, "error": reply.error}  # fmt: skip
            with open(log_file, "a") as f:
                f.write(json.dumps(record) + "\n")
    for i, traj in enumerate(trajectories):
        if flags[i] is None:
            flags[i] = [overall_scores[i] > 0] * len(traj.steps)
    latencies.sort()
    metrics = {
        "prm/label_requests": float(len(requests)),
        "prm/label_failures": float(failures),
        "prm/parse_failures": float(parse_failures),
        "prm/skipped": float(skipped),
        "prm/good_rate": judged_good / judged_steps if judged_steps else 0.0,
        "prm/latency_p50": _percentile(latencies, 0.50),
        "prm/latency_p95": _percentile(latencies, 0.95),
    }
    return flags, metrics


def _percentile(sorted_values: Sequence[float], q: float) -> float:
    return float(sorted_values[round(q * (len(sorted_values) - 1))]) if sorted_values else 0.0
