"""The instructor's course jobs, on top of the chapters and the checking machine
(``python -m graders.course COMMAND``; :mod:`graders.course.__main__` is the command line).

- :mod:`~graders.course.jobs`: the demo course, the learner version, the trusted re-grade, fingerprints.
- :mod:`~graders.course.instructor`: a real course's whole grading run (``grade``).
- :mod:`~graders.course.autograde`: nbgrader autograde in parallel sandboxed workers.
- :mod:`~graders.course.integrity`, :mod:`~graders.course.tamper`, :mod:`~graders.course.output_cap`:
  the graders' fingerprint, suspicious answer code, output caps before feedback.
- :mod:`~graders.course.mutation`: the catalogues of wrong answers and the sample learners.
"""
