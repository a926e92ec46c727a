# Not named "kernels": pytest puts tests/ on sys.path, and transformers (>= 5.25) imports the
# Hugging Face "kernels" distribution, which a tests/kernels package would shadow.
