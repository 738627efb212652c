"""Head importance of a fine-tuned classifier, in Michel et al.'s setting (BERT on a GLUE task).

    python examples/classifier.py textattack/bert-base-uncased-SST-2 --source sst2_dev.tsv --out runs/sst2

DATA is a TSV: text<TAB>label, or text_a<TAB>text_b<TAB>label (the label a class index or one
of the model's label names). Scores every head by gradient importance and ablation on the task
loss, and prints the heads whose removal costs the most accuracy.
"""

import argparse

from headlab.importance import ImportanceConfig, describe_model, read_data, run_importance, save_results
from headlab.loading import load_model, load_tokenizer


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--source", "--data", required=True, help="labelled TSV (--data: its old name)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    model, tokenizer = load_model(args.model), load_tokenizer(args.model)
    info = describe_model(model, tokenizer)  # arch "classifier": the task loss, the labels
    data = read_data(args.source, tokenizer, info)
    result = run_importance(model, data, info, ImportanceConfig(methods=("gradient", "ablation"), progress=False))
    save_results(result, args.out)
    drop = result.scores["ablation_accuracy"]
    print(f"accuracy of the full model: {drop.signature['base_accuracy']:.1%} on {len(data)} texts")
    print("heads whose removal costs the most accuracy:")
    for (kind, layer, head), value in sorted(drop.items(), key=lambda item: -item[1])[:5]:
        print(f"  {kind} layer {layer} head {head}: accuracy {-value:+.1%}")  # value: the drop
    print(f"gradient importance vs ablation (Spearman): {result.agreement.rho['gradient']['all']:+.2f}")


if __name__ == "__main__":
    main()
