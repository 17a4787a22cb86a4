# Regenerates the LRT references in this folder with R DESeq2 (Debian r-bioc-deseq2 1.38.3):
#   Rscript tests/data/deseq/make_lrt_reference.R <shared data dir> <out dir>
suppressMessages(library(DESeq2))
args <- commandArgs(trailingOnly = TRUE)
shared <- args[1]; out <- args[2]
cts <- as.matrix(read.csv(file.path(shared, "deseq_refs/datasets/synthetic/test_counts.csv"), row.names = 1))
md <- read.csv(file.path(shared, "deseq_refs/datasets/synthetic/test_metadata.csv"), row.names = 1)
md$condition <- factor(md$condition); md$group <- factor(md$group)
dds <- DESeqDataSetFromMatrix(cts, md, ~ group + condition)
dds <- DESeq(dds, test = "LRT", reduced = ~ group, quiet = TRUE)
write.csv(as.data.frame(results(dds, contrast = c("condition", "B", "A"))), file.path(out, "lrt_multi_factor_R.csv"))
pc <- as.matrix(read.csv(file.path(shared, "bulk/pasilla/counts.csv"), row.names = 1))
pm <- read.csv(file.path(shared, "bulk/pasilla/metadata.csv"), row.names = 1)
pm$condition <- factor(pm$condition, levels = c("untreated", "treated")); pm$type <- factor(pm$type)
dds <- DESeqDataSetFromMatrix(pc, pm, ~ type + condition)
dds <- DESeq(dds, test = "LRT", reduced = ~ type, quiet = TRUE)
res <- as.data.frame(results(dds))
write.csv(signif(res[, c("log2FoldChange", "stat", "pvalue", "padj")], 7), gzfile(file.path(out, "lrt_pasilla_type_condition_R.csv.gz")))
