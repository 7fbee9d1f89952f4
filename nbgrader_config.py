"""nbgrader configuration of the book. The course root is this folder by default; the main job
(``python -m graders.course demo``) copies the notebooks into a temporary course folder instead."""
c = get_config()  # noqa: F821

c.CourseDirectory.course_id = "multi-lora-serving"
# One subfolder per assignment (chapter): notebooks/01_lora_basics/01_lora_basics.ipynb
c.CourseDirectory.source_directory = "notebooks"
c.CourseDirectory.release_directory = "release"
c.CourseDirectory.submitted_directory = "submitted"
c.CourseDirectory.autograded_directory = "autograded"
c.CourseDirectory.feedback_directory = "feedback"

c.ClearSolutions.code_stub = {"python": "# YOUR CODE HERE\nraise NotImplementedError()"}
# A test cell runs the learner's answer in a child process with its own budget (graders.machine.core,
# 40 s on the CPU and 90 s on a GPU, where learner kernels compile; tests/test_graders.py checks
# that grading the reference takes under half of it); this cell limit sits
# well above it so a correct answer never times out on 2 CPU cores.
c.Execute.timeout = 300
c.Execute.interrupt_on_timeout = True
# Stray warnings on stderr (e.g. from a library a learner imports) must not zero a test cell.
c.IgnorePattern.enabled = True
c.IgnorePattern.pattern = r"(Warning|WARNING)"
