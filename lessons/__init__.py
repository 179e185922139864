"""Guided lessons: each explains one mechanism, runs a scenario in which it happens, and checks that the
learner saw it. ``minipaged lessons`` lists them; ``minipaged watch --lesson N`` opens one.

    from minipaged.lessons import list_lessons, get_lesson, run_scenario
    lesson = get_lesson(3)
    print(lesson.title, lesson.markdown)            # the text, numbers filled from the last measured run
    result = run_scenario(lesson, model="smollm2")  # run every variant headless and measure again
    print(result.values)

See ``core.py`` for how a lesson is put together.
"""
from .core import (Checkpoint, CheckpointTracker, Lesson, QuizQuestion, Run, Scenario, ScenarioFeed,
                   ScenarioResult, Trace, get_lesson, list_lessons, run_scenario, run_variant)

__all__ = ["Checkpoint", "CheckpointTracker", "Lesson", "QuizQuestion", "Run", "Scenario", "ScenarioFeed",
           "ScenarioResult", "Trace", "get_lesson", "list_lessons", "run_scenario", "run_variant"]
