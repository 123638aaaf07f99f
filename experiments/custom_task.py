"""Your own task: SFT, then GRPO teach a tiny model to add three digits. Options: --preset, section.field=value."""
import random
from grpo_jax import cli
from grpo_jax.tasks import custom, shortcuts
from grpo_jax.cli.train import sft_then_rl

def question(rng: random.Random) -> tuple[str, str]:  # a prompt and its reference answer
    a, b, c = rng.randint(0, 9), rng.randint(0, 9), rng.randint(0, 9)
    return f"{a}+{b}+{c}=", str(a + b + c)

def reward(prompt: str, completion: str, answer: str) -> float:
    return 1.0 if completion.strip() == answer else 0.0

def solution(prompt: str, answer: str, rng: random.Random) -> str:  # SFT data: right 40% of the time
    return answer if rng.random() < 0.4 else str(int(answer) + 1)

def main(argv: list[str]) -> dict:
    defaults = ["run.run_dir=runs/custom_task", "run.steps=80", "rl.max_new_tokens=4", "optimizer.peak_lr=3e-4"]
    task = custom.CustomTask(question, reward, solution=solution, shortcuts=shortcuts.numeric_rules)  # units-digit rules
    r = sft_then_rl(task, defaults + argv, sft_steps=800)
    print(f"held-out greedy reward: {r['before']['reward']:.2f} -> {r['after']['reward']:.2f} (best shortcut {r['shortcuts']['best_score']:.2f})")
    return r

if __name__ == "__main__":
    cli.run(main, pass_argv=True)
