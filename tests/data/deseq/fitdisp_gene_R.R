# R DESeq2 1.38.3: the inputs and the line search of fitDisp for one pasilla gene (MAP step, ~type + condition),
# printed for tests/deseq/test_deseq_kernels.py::test_fitdisp_matches_r_on_a_gene. Reads the pasilla counts and
# sample table (gpuc.datasets.pasilla) from the shared data folder.
suppressMessages(library(DESeq2))
cts <- as.matrix(read.csv("/work/shared/data/bulk/pasilla/counts.csv", row.names=1, check.names=FALSE))
md <- read.csv("/work/shared/data/bulk/pasilla/metadata.csv", row.names=1)
md$condition <- factor(md$condition, levels=c("untreated","treated"))
md$type <- factor(md$type)
dds <- DESeqDataSetFromMatrix(cts, md, ~type + condition)
dds <- estimateSizeFactors(dds)
dds <- estimateDispersionsGeneEst(dds)
dds <- estimateDispersionsFit(dds)
dds <- estimateDispersionsMAP(dds)
fn <- dispersionFunction(dds)
cat(sprintf("%.17g %.17g\n", attr(fn,"varLogDispEsts"), attr(fn,"dispPriorVar")))
g <- "FBgn0032518"
m <- mcols(dds)[g,]
mu <- assays(dds)[["mu"]][g,,drop=FALSE]
mm <- model.matrix(~type + condition, md)
init <- ifelse(m$dispGeneEst > 0.1*m$dispFit, m$dispGeneEst, m$dispFit)
r <- DESeq2:::fitDispWrapper(ySEXP=counts(dds)[g,,drop=FALSE], xSEXP=mm, mu_hatSEXP=mu, log_alphaSEXP=log(init), log_alpha_prior_meanSEXP=log(m$dispFit), log_alpha_prior_sigmasqSEXP=attr(fn,"dispPriorVar"), min_log_alphaSEXP=log(1e-9), kappa_0SEXP=1, tolSEXP=1e-6, maxitSEXP=100, usePriorSEXP=TRUE, weightsSEXP=matrix(1,1,7), useWeightsSEXP=FALSE, weightThresholdSEXP=1e-2, useCRSEXP=TRUE)
cat(sprintf("%.17g %d %.17g  mapR %.17g iter %d\n", exp(r$log_alpha), r$iter, r$last_lp, m$dispMAP, m$dispIter))
cat(sprintf("%.17g %.17g %.17g\n", m$dispGeneEst, m$dispFit, init))
print(format(mu, digits=17))
for (k in 1:11) {
r <- DESeq2:::fitDispWrapper(ySEXP=counts(dds)[g,,drop=FALSE], xSEXP=mm, mu_hatSEXP=mu, log_alphaSEXP=log(init), log_alpha_prior_meanSEXP=log(m$dispFit), log_alpha_prior_sigmasqSEXP=attr(fn,"dispPriorVar"), min_log_alphaSEXP=log(1e-9), kappa_0SEXP=1, tolSEXP=1e-6, maxitSEXP=k, usePriorSEXP=TRUE, weightsSEXP=matrix(1,1,7), useWeightsSEXP=FALSE, weightThresholdSEXP=1e-2, useCRSEXP=TRUE)
cat(sprintf("%d la %.12f lp %.12f dlp %.6g acc %d init %.12f\n", k, r$log_alpha, r$last_lp, r$last_dlp, r$iter_accept, r$initial_lp))
}
