# %% [markdown]
# # headlab in a notebook
#
# Which heads of a model matter, what they do, and pruning the rest, in a few calls on a model
# you have already loaded (any device, any dtype). This file is a notebook in the percent
# format: open it in Jupyter (jupytext), VS Code or Spyder, or run it as a script
# (`python examples/notebook.py`, which the tests do). So that it runs anywhere without a
# download, the model is a tiny random GPT-2 built from a config and a one-word-per-token
# tokenizer; with your own model, replace the next cell by
# `model = transformers.AutoModelForCausalLM.from_pretrained(...)` and its tokenizer.

# %%
import tempfile

import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

import headlab

try:
    from IPython.display import display  # in a notebook: the HTML heatmaps
except ImportError:  # as a script: the text summary
    display = print

TEXTS = ["the old dog quickly chased a red ball", "cats sleep here", "birds sing and fish swim",
         "a very big zebra ate green grass slowly"]
vocab = {"<|endoftext|>": 0}
for word in " ".join(TEXTS).split():
    vocab.setdefault(word, len(vocab))
core = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<|endoftext|>",
                                                 eos_token="<|endoftext|>", unk_token="<|endoftext|>")
config = transformers.GPT2Config(vocab_size=len(vocab), n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                 bos_token_id=0, eos_token_id=0)
model = transformers.GPT2LMHeadModel(config)

# %% [markdown]
# A treebank can be a CoNLL-U file, CoNLL-U text (as here) or sentences already parsed
# (`headlab.data.treebank.read_conllu(path)`). Functions and aggregate statistics are computed
# on its sentences; importance on `TEXTS`.

# %%
CONLLU = """\
# text = the old dog quickly chased a red ball
1\tthe\tthe\tDET\t_\t_\t3\tdet\t_\t_
2\told\told\tADJ\t_\t_\t3\tamod\t_\t_
3\tdog\tdog\tNOUN\t_\t_\t5\tnsubj\t_\t_
4\tquickly\tquickly\tADV\t_\t_\t5\tadvmod\t_\t_
5\tchased\tchase\tVERB\t_\t_\t0\troot\t_\t_
6\ta\ta\tDET\t_\t_\t8\tdet\t_\t_
7\tred\tred\tADJ\t_\t_\t8\tamod\t_\t_
8\tball\tball\tNOUN\t_\t_\t5\tobj\t_\t_

# text = birds sing and fish swim
1\tbirds\tbird\tNOUN\t_\t_\t2\tnsubj\t_\t_
2\tsing\tsing\tVERB\t_\t_\t0\troot\t_\t_
3\tand\tand\tCCONJ\t_\t_\t5\tcc\t_\t_
4\tfish\tfish\tNOUN\t_\t_\t5\tnsubj\t_\t_
5\tswim\tswim\tVERB\t_\t_\t2\tconj\t_\t_
"""

analysis = headlab.analyze(model, tokenizer, TEXTS, treebank=CONLLU)
display(analysis)  # heatmaps of every measure and statistic, function labels, agreement

# %% [markdown]
# The tidy table (one row per model, kind, layer, head, measure, value) stacks across models
# with `pandas.concat`; `heads()` is the wide table of `headlab analyze`'s heads.csv.

# %%
try:
    frame = analysis.to_pandas()
    display(frame.pivot_table(index="measure", values="value", aggfunc="mean"))
    display(analysis.heads().head())
except headlab.HeadlabError as missing:  # pandas is an optional extra: pip install 'headlab[pandas]'
    print(missing)
    print(analysis.records()[:3])

# %% [markdown]
# One measure on its own, and pruning: keep the 6 heads that LRP scores highest.

# %%
lrp = headlab.importance(model, tokenizer, TEXTS, measures="lrp").scores["lrp"]
display(lrp)
kept = headlab.prune(model, lrp, keep=6)
print("heads kept per layer:", kept)
print("parameters now:", headlab.count_parameters(model))

# %% [markdown]
# `save` writes the directory `headlab analyze --out` writes (`report=True`: with the HTML
# report, index.html); `Analysis.load` reads either.

# %%
with tempfile.TemporaryDirectory() as directory:
    analysis.save(directory)
    again = headlab.Analysis.load(directory)
    assert again.tables.keys() == analysis.tables.keys() and again.labels == analysis.labels
    print(again)
