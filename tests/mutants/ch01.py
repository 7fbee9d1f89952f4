"""Wrong answers for chapter 01 (graders.mutation.Mutant): each is the solution cell with one edit."""
from graders.mutation import Mutant

MUTANTS = [
]
