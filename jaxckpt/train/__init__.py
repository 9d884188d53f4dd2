"""The trainer: its config checks, its state and step functions, resume, the save cadence, weights
from elsewhere (`init_from`, `.bin` resumes) and the loop that ties them together (`loop`)."""
